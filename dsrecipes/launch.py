"""Launchers: `LauncherKind -> command builder`, and running what the builders return.

The process that ran Hydra has already written `<run>/config.yaml` and `<run>/ds_config.json`; a launcher only
starts ranks that run `python -m dsrecipes.worker --run-dir RUN`. Each builder is a pure function of the config
(plus a resolved master port), returning a `LaunchPlan`: the commands, the support files to write into the run
directory (hostfile, sbatch script, .deepspeed_env) and the tools that must exist. `launch()` writes the files and
`<run>/launch.txt`, checks the tools, and runs the commands meant for this machine (or only prints them with
`launcher.dry_run=true`).

Launcher binaries are started as `python -m deepspeed.launcher.runner` / `python -m torch.distributed.run` with
the interpreter running this code (the same thing the `deepspeed` / `torchrun` scripts do), so ranks always use the
environment that validated the config, whatever is first on PATH.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

from dsrecipes.config.schema import LauncherConfig, LauncherKind, TrainConfig
from dsrecipes.errors import UserError

WORKER_MODULE = "dsrecipes.worker"
DEFAULT_MASTER_PORT = LauncherConfig().master_port  # the schema's default; "left at default" means "pick one"
LAUNCH_FILE = "launch.txt"
SBATCH_FILE = "launch.sbatch"
HOSTFILE = "hostfile"
DS_ENV_FILE = ".deepspeed_env"
# Inherited rank variables would confuse the ranks we start (and make DeepSpeed skip MPI discovery).
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")


@dataclass(frozen=True)
class Command:
    """One command line. `env` is set on top of this process's environment (minus inherited rank variables)."""

    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    node_rank: Optional[int] = None  # multi-node: the node that runs it; None = this machine (or every node)
    in_process: bool = False  # launcher=local: `dsrecipes.worker.run(run_dir)` in this process, argv shown only

    def shell(self) -> str:
        prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join(prefix + [shlex.join(self.argv)])


@dataclass(frozen=True)
class Requirement:
    """Something a plan needs on this machine: an executable on PATH or an importable module."""

    name: str
    module: bool
    why: str

    def missing(self) -> bool:
        if self.module:
            return importlib.util.find_spec(self.name) is None
        return shutil.which(self.name) is None


@dataclass
class LaunchPlan:
    commands: List[Command]
    files: Dict[str, str] = field(default_factory=dict)  # name inside the run dir -> content
    requires: List[Requirement] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # printed in launch.txt: how to use the commands


# ---------------------------------------------------------------------------------------------------------------
# Builders. Signature: (cfg, run_dir, port, worker_module, environ) -> LaunchPlan


def _absolute(path: str) -> str:
    """Commands may run elsewhere (other nodes, launch.txt re-run from another directory): no relative paths."""
    return str(Path(path).expanduser().resolve())


def _worker_args(worker_module: str, run_dir: Path) -> List[str]:
    return ["-m", worker_module, "--run-dir", str(run_dir)]


def _build_local(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.update(cfg.launcher.env)
    cmd = Command([sys.executable, *_worker_args(worker_module, run_dir)], env, in_process=True)
    return LaunchPlan(
        [cmd], notes=["launcher=local runs the worker inside this process; the line shows the equivalent"]
    )


def _deepspeed_resource_args(ln: LauncherConfig) -> List[str]:
    args: List[str] = []
    if ln.hostfile:
        args += ["--hostfile", _absolute(ln.hostfile)]
    if ln.include:
        args += ["--include", ln.include]
    elif ln.exclude:
        args += ["--exclude", ln.exclude]
    else:
        if ln.hostfile:
            args += ["--num_nodes", str(ln.num_nodes)]
        if ln.num_gpus is not None:
            args += ["--num_gpus", str(ln.num_gpus)]
    return args


def _cuda_visible_warning(ln: LauncherConfig, environ: Mapping[str, str]) -> List[str]:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not (ln.num_gpus is not None or ln.include or ln.exclude or ln.num_nodes > 1):
        return []
    return [
        f"CUDA_VISIBLE_DEVICES={visible} is ignored by the deepspeed launcher when --num_gpus/--include/--exclude "
        "are given; pick devices with launcher.include=localhost:0,1 launcher.num_gpus=null"
    ]


def _build_deepspeed(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    ln = cfg.launcher
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", *_deepspeed_resource_args(ln)]
    if ln.hostfile and ln.master_addr != LauncherConfig().master_addr:
        argv += ["--master_addr", ln.master_addr]
    argv += ["--master_port", str(port), *ln.extra_args, "--no_local_rank", "--module", worker_module]
    argv += ["--run-dir", str(run_dir)]
    env = dict(ln.env)
    plan = LaunchPlan([Command(argv, env)], warnings=_cuda_visible_warning(ln, environ))
    plan.requires.append(Requirement("deepspeed", True, "the deepspeed launcher"))
    if ln.hostfile:
        # Only the ssh (pdsh) multi-node path reads .deepspeed_env; DS_ENV_FILE points it at the run's own copy.
        plan.files[DS_ENV_FILE] = "".join(f"{k}={v}\n" for k, v in sorted(ln.env.items()))
        env["DS_ENV_FILE"] = str(run_dir / DS_ENV_FILE)
        if ln.num_nodes > 1:
            plan.requires.append(
                Requirement("pdsh", False, "deepspeed reaches the other hosts of a hostfile with pdsh")
            )
    return plan


def _node_hostfile(ln: LauncherConfig) -> str:
    lines = ["# written by dsrecipes: one line per node; names only label nodes in --no_ssh mode"]
    lines += [f"node{i} slots={per_node(ln)}" for i in range(ln.num_nodes)]
    return "\n".join(lines) + "\n"


def _build_deepspeed_multinode(cfg, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    ln = cfg.launcher
    plan = LaunchPlan([], requires=[Requirement("deepspeed", True, "the deepspeed launcher")])
    hostfile = _absolute(ln.hostfile) if ln.hostfile else None
    if not hostfile:
        # --no_ssh still takes the node list (and rank offsets) from a hostfile; node names are only labels.
        plan.files[HOSTFILE] = _node_hostfile(ln)
        hostfile = str(run_dir / HOSTFILE)
    for node in range(ln.num_nodes):
        argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile]
        argv += ["--num_nodes", str(ln.num_nodes), "--num_gpus", str(per_node(ln))]
        argv += ["--no_ssh", "--node_rank", str(node), "--master_addr", ln.master_addr, "--master_port", str(port)]
        argv += [*ln.extra_args, "--no_local_rank", "--module", worker_module, "--run-dir", str(run_dir)]
        plan.commands.append(Command(argv, dict(ln.env), node_rank=node))
    plan.warnings += _cuda_visible_warning(ln, environ)
    plan.notes.append(
        "run command N on node N (all at once); this machine runs the one for launcher.node_rank. "
        "In --no_ssh mode deepspeed does not read .deepspeed_env: launcher.env is exported to each command instead"
    )
    return plan


def _build_torchrun(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    ln = cfg.launcher
    endpoint = ln.rdzv_endpoint or f"{ln.master_addr}:{port}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(per_node(ln))]
    argv += ["--nnodes", str(ln.num_nodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint]
    argv += ["--rdzv_id", f"dsrecipes-{run_dir.name}", *ln.extra_args, *_worker_args(worker_module, run_dir)]
    plan = LaunchPlan([Command(argv, dict(ln.env))])
    if ln.num_nodes > 1:
        plan.notes.append("multi-node torchrun: run this same command on every node; c10d assigns node ranks")
    return plan


def _build_mpirun(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    ln = cfg.launcher
    nprocs = per_node(ln) * ln.num_nodes
    argv = ["mpirun", "-np", str(nprocs)]
    if ln.hostfile:
        argv += ["--hostfile", _absolute(ln.hostfile)]
    # Each rank runs our shim: DeepSpeed's own mpi4py discovery (with our port), then the worker module.
    argv += [*ln.extra_args, sys.executable, "-m", "dsrecipes.launch", "mpi-rank", "--master-port", str(port)]
    if ln.num_nodes == 1 or ln.master_addr != LauncherConfig().master_addr:
        argv += ["--master-addr", ln.master_addr]
    for key, value in sorted(ln.env.items()):  # forwarded as arguments: MPI implementations export env differently
        argv += ["--env", f"{key}={value}"]
    argv += ["--module", worker_module, "--", "--run-dir", str(run_dir)]
    env = {}
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # Open MPI refuses root else
    return LaunchPlan(
        [Command(argv, env)],
        requires=[
            Requirement("mpirun", False, "launcher=mpirun needs an MPI installation (e.g. apt install openmpi-bin)"),
            Requirement("mpi4py", True, "ranks discover rank/world size through mpi4py (pip install mpi4py)"),
        ],
    )


def _build_slurm(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    script = run_dir / SBATCH_FILE
    plan = LaunchPlan(
        [Command(["sbatch", str(script)])],
        files={SBATCH_FILE: sbatch_script(cfg, run_dir, port, worker_module)},
        requires=[Requirement("sbatch", False, "launcher=slurm submits with sbatch (run on a SLURM login node)")],
    )
    plan.notes.append(f"the job runs asynchronously; its log is {run_dir}/slurm-<jobid>.out")
    return plan


def sbatch_script(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str = WORKER_MODULE) -> str:
    """One srun task per node; each starts the no-ssh deepspeed launcher with node rank SLURM_NODEID."""
    ln = cfg.launcher
    q = shlex.quote
    head = [
        "#!/bin/bash",
        f"# Written by dsrecipes for {run_dir}. Submit with: sbatch {run_dir / SBATCH_FILE}",
        f"#SBATCH --job-name=dsrecipes-{run_dir.name}",
        f"#SBATCH --nodes={ln.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node(ln)}",
        f"#SBATCH --time={ln.slurm_time_min}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
    ]
    if ln.slurm_partition:
        head.append(f"#SBATCH --partition={ln.slurm_partition}")
    if ln.slurm_account:
        head.append(f"#SBATCH --account={ln.slurm_account}")
    head += [f"#SBATCH {arg}" for arg in ln.slurm_sbatch_args]
    inner = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "$HOSTFILE",
        "--num_nodes", str(ln.num_nodes), "--num_gpus", str(per_node(ln)),
        "--no_ssh", "--node_rank", "$SLURM_NODEID", "--master_addr", "$MASTER_ADDR", "--master_port", "$MASTER_PORT",
        *ln.extra_args,
        "--no_local_rank", "--module", worker_module, "--run-dir", str(run_dir),
    ]  # fmt: skip
    # $VARS stay unquoted inside the per-task shell so that each task expands its own SLURM_NODEID.
    inner_sh = " ".join(a if a.startswith("$") else q(a) for a in inner)
    body = [
        "set -euo pipefail",
        f"cd {q(os.getcwd())}",
        *ln.slurm_setup,
        *[f"export {k}={q(v)}" for k, v in sorted(ln.env.items())],
        # no `| head` under pipefail: scontrol would die of SIGPIPE on long node lists
        'HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "MASTER_ADDR=$(printf '%s\\n' $HOSTS | sed -n 1p)",
        f"MASTER_PORT={port}",
        f"HOSTFILE={q(str(run_dir))}/hostfile.$SLURM_JOB_ID",
        f"printf '%s slots={per_node(ln)}\\n' $HOSTS > \"$HOSTFILE\"",
        "export MASTER_ADDR MASTER_PORT HOSTFILE",
        f"srun --nodes={ln.num_nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {q('exec ' + inner_sh)}",
    ]
    return "\n".join(head + [""] + body) + "\n"


BUILDERS: Dict[LauncherKind, Callable[..., LaunchPlan]] = {
    LauncherKind.local: _build_local,
    LauncherKind.deepspeed: _build_deepspeed,
    LauncherKind.deepspeed_multinode: _build_deepspeed_multinode,
    LauncherKind.torchrun: _build_torchrun,
    LauncherKind.mpirun: _build_mpirun,
    LauncherKind.slurm: _build_slurm,
}


# ---------------------------------------------------------------------------------------------------------------
# Public API


def build_plan(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    master_port: Optional[int] = None,
    worker_module: str = WORKER_MODULE,
    environ: Optional[Mapping[str, str]] = None,
) -> LaunchPlan:
    """The commands, support files and requirements for `cfg.launcher.kind` (pure but for the port choice)."""
    port = resolve_master_port(cfg) if master_port is None else master_port
    env = os.environ if environ is None else environ
    return BUILDERS[cfg.launcher.kind](cfg, Path(run_dir).resolve(), port, worker_module, env)


def build_commands(cfg: TrainConfig, run_dir: Path, **kwargs) -> List[Command]:
    return build_plan(cfg, run_dir, **kwargs).commands


def launch(cfg: TrainConfig, run_dir: Path, *, worker_module: str = WORKER_MODULE) -> int:
    """Start the ranks for `cfg` (or print them with launcher.dry_run); returns the exit code of this node's ranks.

    Writes the plan's support files and `<run>/launch.txt`. A missing tool (mpirun, mpi4py, sbatch, ...) raises
    UserError (exit 2) before anything starts.
    """
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = build_plan(cfg, run_dir, worker_module=worker_module)
    for name, content in plan.files.items():
        (run_dir / name).write_text(content, encoding="utf-8")
    text = render_plan(cfg, plan)
    (run_dir / LAUNCH_FILE).write_text(text, encoding="utf-8")
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if cfg.launcher.dry_run:
        print(text, end="")
        return 0
    missing = [
        f"launcher.kind={cfg.launcher.kind.value}: {r.name} not found ({r.why})" for r in plan.requires if r.missing()
    ]
    if missing:
        raise UserError(missing)
    mine = [c for c in plan.commands if c.node_rank is None or c.node_rank == cfg.launcher.node_rank]
    for cmd in mine:
        code = _run_in_process(cmd, run_dir) if cmd.in_process else _run_subprocess(cmd)
        if code != 0:
            return code
    return 0


def render_plan(cfg: TrainConfig, plan: LaunchPlan) -> str:
    lines = [f"# launcher={cfg.launcher.kind.value} (written by dsrecipes.launch)"]
    lines += [f"# note: {n}" for n in plan.notes]
    lines += [f"# warning: {w}" for w in plan.warnings]
    lines += [f"# wrote {name} into the run directory" for name in plan.files]
    for cmd in plan.commands:
        if cmd.node_rank is not None:
            lines.append(f"# node {cmd.node_rank}")
        lines.append(cmd.shell())
    return "\n".join(lines) + "\n"


def world_size(cfg: TrainConfig) -> int:
    """Number of ranks the configured launcher will start (what the DeepSpeed batch arithmetic must use)."""
    ln = cfg.launcher
    if ln.kind is LauncherKind.local:
        return 1
    if ln.kind is LauncherKind.deepspeed:
        return _deepspeed_world_size(ln)
    return per_node(ln) * ln.num_nodes


def per_node(ln: LauncherConfig) -> int:
    """Ranks per node: launcher.num_gpus, or every device of this machine when it is null."""
    return ln.num_gpus or local_devices()


def local_devices() -> int:
    """CUDA devices on this machine; 1 on a CPU-only machine."""
    import torch

    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


def _deepspeed_world_size(ln: LauncherConfig) -> int:
    # Same resolution as deepspeed/launcher/runner.py: hostfile (or this machine), include/exclude, num_nodes/gpus.
    from deepspeed.launcher import runner

    if ln.hostfile:
        pool = runner.fetch_hostfile(ln.hostfile)
    else:
        if ln.num_gpus is not None and not (ln.include or ln.exclude):
            return ln.num_gpus
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible and not (ln.include or ln.exclude):  # the runner turns it into --include localhost:<ids>
            return len([d for d in visible.split(",") if d.strip()])
        from deepspeed.accelerator import get_accelerator

        pool = {"localhost": get_accelerator().device_count()}
    active = runner.parse_inclusion_exclusion(pool, ln.include or "", ln.exclude or "")
    if not (ln.include or ln.exclude):
        active = runner.apply_num_nodes_and_gpus(active, ln.num_nodes if ln.hostfile else -1, ln.num_gpus or -1)
    return sum(len(slots) for slots in active.values())


def resolve_master_port(cfg: TrainConfig) -> int:
    """A free port when the config leaves the default on a single node (concurrent runs), else the configured one."""
    ln = cfg.launcher
    single = ln.num_nodes == 1 and ln.kind not in (LauncherKind.slurm, LauncherKind.deepspeed_multinode)
    if ln.master_port == DEFAULT_MASTER_PORT and single and not ln.hostfile:
        return free_port()
    return ln.master_port


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------
# Running


def _child_env(extra: Mapping[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update(extra)
    return env


def _run_subprocess(cmd: Command) -> int:
    proc = subprocess.Popen(cmd.argv, env=_child_env(cmd.env))
    # Pass a SIGTERM (scheduler, timeout) on to the launcher, which stops its ranks; no orphaned ranks.
    forward = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate()) if forward else None
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        if forward:
            signal.signal(signal.SIGTERM, previous)


def _run_in_process(cmd: Command, run_dir: Path) -> int:
    import dsrecipes.worker as worker

    saved = {k: os.environ.get(k) for k in cmd.env}
    os.environ.update(cmd.env)
    try:
        result = worker.run(run_dir)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return result if isinstance(result, int) else 0


def mpi_rank_main(argv: Sequence[str]) -> int:
    """`python -m dsrecipes.launch mpi-rank ...`: what each mpirun rank runs before the worker module.

    DeepSpeed's own mpi4py discovery (rank, world size, local rank, master address from rank 0) fills RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, with our port instead of its fixed 29500, so that
    `deepspeed.init_distributed()` in the worker finds a complete env:// setup.
    """
    import runpy

    parser = argparse.ArgumentParser(prog="python -m dsrecipes.launch mpi-rank")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--master-addr", default=None, help="default: rank 0's address (hostname -I)")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE exported before the worker starts")
    parser.add_argument("--module", default=WORKER_MODULE)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(list(argv))
    try:
        from deepspeed.comm.comm import mpi_discovery
    except ImportError as exc:
        print(f"error: launcher=mpirun needs mpi4py and deepspeed in this environment ({exc})", file=sys.stderr)
        return 2
    mpi_discovery(distributed_port=args.master_port, verbose=False)
    if args.master_addr:
        os.environ["MASTER_ADDR"] = args.master_addr
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["mpi-rank"]:
        print("usage: python -m dsrecipes.launch mpi-rank --master-port P [--master-addr A] --module M -- ARGS")
        raise SystemExit(2)
    raise SystemExit(mpi_rank_main(sys.argv[2:]))
