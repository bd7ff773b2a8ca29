"""`LauncherKind -> command builder`. Each builder is a pure function of the config (plus a resolved master port)
returning a `LaunchPlan`: the commands, the support files to write into the run directory (hostfile, sbatch script,
.deepspeed_env) and the tools that must exist.

Launcher binaries are started as `python -m deepspeed.launcher.runner` / `python -m torch.distributed.run` with the
interpreter running this code (the same thing the `deepspeed` / `torchrun` scripts do), so ranks always use the
environment that validated the config, whatever is first on PATH. A single-node `launcher=deepspeed` run starts
what DeepSpeed's runner would start for it, the per-node launcher `deepspeed.launcher.launch` (one Python
process fewer that imports all of DeepSpeed before a rank starts: about 3.5 CPU seconds), run by
`dsrecipes.run.launch.ds_node` (its own main(), DeepSpeed imported without mlflow: ~1.9 CPU seconds less); so does each
node of a `launcher=deepspeed_multinode` run without a hostfile (what the runner's --no_ssh path starts on node N).
The runner stays for hostfiles, --include/--exclude and CUDA_VISIBLE_DEVICES, which it resolves itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

from dsrecipes.boundary.batch_script import PDSH_READS, run_dir_problem
from dsrecipes.boundary.launcher_args import (
    FORCE_MULTI,
    NODE_ENTRY,
    checked_extra_args,
    deepspeed_node_args,
    hostfile_problems,
)
from dsrecipes.boundary.rank_env import checked_env, store_settings_from
from dsrecipes.boundary.values import HOST
from dsrecipes.core.distributed import free_port
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import LauncherConfig, LauncherKind, TrainConfig
from dsrecipes.core.topology import deepspeed_local_slots, per_node
from dsrecipes.run.launch.plan import DS_ENV_FILE, HOSTFILE, Command, LaunchPlan, Requirement, torchrun_shutdown
from dsrecipes.run.launch.slurm import build_slurm

# Multi-node runs need one port every node agrees on; with launcher.master_port unset that is DeepSpeed's default.
MULTINODE_DEFAULT_PORT = 29500
def _absolute(path: str) -> str:
    """Commands may run elsewhere (other nodes, launch.txt re-run from another directory): no relative paths."""
    return str(Path(path).expanduser().resolve())


def _hostfile(path: str) -> str:
    """A user's hostfile, absolute; its host names reach pdsh/ssh and mpirun, so they are checked (when it exists
    here: a dry run may name one that lives on the cluster only)."""

    if Path(path).expanduser().is_file() and hostfile_problems(path):
        raise ConfigError(hostfile_problems(path))
    return _absolute(path)


def _worker_args(worker_module: str, run_dir: Path) -> List[str]:
    return ["-m", worker_module, "--run-dir", str(run_dir)]


def _build_local(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.update(checked_env(cfg.launcher.env))
    checked_extra_args(LauncherKind.local, cfg.launcher.extra_args)
    cmd = Command([sys.executable, *_worker_args(worker_module, run_dir)], env, in_process=True)
    return LaunchPlan(
        [cmd], notes=["launcher=local runs the worker inside this process (a sweep's job: this line, as a child "
                      "process, so that a job that stalls or crashes ends alone); the line shows the equivalent"]
    )


def _deepspeed_resource_args(ln: LauncherConfig) -> List[str]:
    args: List[str] = []
    if ln.hostfile:
        args += ["--hostfile", _hostfile(ln.hostfile)]
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
    node = _deepspeed_node_plan(ln, run_dir, port, worker_module, environ)
    if node is not None:
        return node
    if ln.hostfile or FORCE_MULTI in checked_extra_args(ln.kind, ln.extra_args):  # the runner may go through pdsh
        _pdsh_words(run_dir, ln.master_addr)
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", *_deepspeed_resource_args(ln)]
    if ln.hostfile and ln.master_addr != LauncherConfig().master_addr:
        argv += ["--master_addr", ln.master_addr]
    extra = checked_extra_args(ln.kind, ln.extra_args)
    argv += ["--master_port", str(port), *extra, "--no_local_rank", "--module", worker_module]
    argv += ["--run-dir", str(run_dir)]
    env = checked_env(ln.env)
    plan = LaunchPlan([Command(argv, env)], warnings=_cuda_visible_warning(ln, environ), requires=[_needs_deepspeed()])
    if ln.hostfile:
        # Only the ssh (pdsh) multi-node path reads .deepspeed_env; DS_ENV_FILE points it at the run's own copy.
        # Remote ranks do not inherit this environment: its object-store settings travel there too.
        store, store_notes = store_settings_from(environ)
        remote = {**store, **env}
        plan.notes += store_notes
        plan.files[DS_ENV_FILE] = "".join(f"{k}={v}\n" for k, v in sorted(remote.items()))
        env["DS_ENV_FILE"] = str(run_dir / DS_ENV_FILE)
        if ln.num_nodes > 1:
            plan.requires.append(
                Requirement("pdsh", False, "deepspeed reaches the other hosts of a hostfile with pdsh")
            )
    return plan


def _pdsh_words(run_dir: Path, master_addr: str) -> None:
    """DeepSpeed's runner with a hostfile (or --force_multi) reaches hosts through pdsh, which joins the command into
    one line for each host's remote shell, quoting nothing: the run directory and the master address must be words a
    shell reads as themselves (checked here, where the line is made, whatever validation saw)."""
    problems = [run_dir_problem(str(run_dir), PDSH_READS)]
    if HOST.check(str(master_addr)):
        problems.append(f"launcher.master_addr: needs {HOST.expected}, got {master_addr!r}")
    if any(problems):
        raise ConfigError([p for p in problems if p])


def _deepspeed_node_plan(ln: LauncherConfig, run_dir: Path, port: int, worker_module: str,
                         environ: Mapping[str, str]) -> Optional[LaunchPlan]:
    """A run on this machine alone: DeepSpeed's per-node launcher, started as its runner would start it."""
    slots = deepspeed_local_slots(ln, environ=environ)
    if slots is None:
        return None
    node = deepspeed_node_args({"localhost": slots}, port, ln.extra_args, worker_module, ["--run-dir", str(run_dir)])
    if node is None:
        return None
    plan = LaunchPlan([_node_launcher(node, checked_env(ln.env))], warnings=_cuda_visible_warning(ln, environ),
                      requires=[_needs_deepspeed()])
    plan.notes.append(f"DeepSpeed's per-node launcher, {len(slots)} rank(s) on this machine: what DeepSpeed's runner "
                      "(the `deepspeed` command) starts for a single-node run")
    return plan


def _node_launcher(args: List[str], env: Dict[str, str], node_rank: Optional[int] = None) -> Command:
    """DeepSpeed's per-node launcher (through our entry, `NODE_ENTRY`) with `args` from `deepspeed_node_args`."""
    return Command([sys.executable, "-u", "-m", NODE_ENTRY, *args], env, node_rank=node_rank)


def _needs_deepspeed() -> Requirement:
    return Requirement("deepspeed", True, "the deepspeed launcher")


def _node_hostfile(ln: LauncherConfig) -> str:
    lines = ["# written by dsrecipes: one line per node; names only label nodes in --no_ssh mode"]
    lines += [f"node{i} slots={per_node(ln)}" for i in range(ln.num_nodes)]
    return "\n".join(lines) + "\n"


def _build_deepspeed_multinode(cfg, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    ln = cfg.launcher
    plan = _deepspeed_nodes_plan(ln, run_dir, port, worker_module) if not ln.hostfile else None
    if plan is not None:
        plan.warnings += _cuda_visible_warning(ln, environ)
        return plan
    plan = LaunchPlan([], requires=[_needs_deepspeed()])
    hostfile = _hostfile(ln.hostfile) if ln.hostfile else None
    if not hostfile:
        # --no_ssh still takes the node list (and rank offsets) from a hostfile; node names are only labels.
        plan.files[HOSTFILE] = _node_hostfile(ln)
        hostfile = str(run_dir / HOSTFILE)
    extra, env = checked_extra_args(ln.kind, ln.extra_args), checked_env(ln.env)
    for node in range(ln.num_nodes):
        argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile]
        argv += ["--num_nodes", str(ln.num_nodes), "--num_gpus", str(per_node(ln))]
        argv += ["--no_ssh", "--node_rank", str(node), "--master_addr", ln.master_addr, "--master_port", str(port)]
        argv += [*extra, "--no_local_rank", "--module", worker_module, "--run-dir", str(run_dir)]
        plan.commands.append(Command(argv, dict(env), node_rank=node))
    plan.warnings += _cuda_visible_warning(ln, environ)
    plan.notes.append(
        "run command N on node N (all at once); this machine runs the one for launcher.node_rank. "
        "In --no_ssh mode deepspeed does not read .deepspeed_env: launcher.env is exported to each command instead"
    )
    return plan


def _deepspeed_nodes_plan(ln: LauncherConfig, run_dir: Path, port: int, worker_module: str) -> Optional[LaunchPlan]:
    """`launcher=deepspeed_multinode` without a hostfile: on node N, DeepSpeed's per-node launcher with what the
    runner's --no_ssh path gives it for node N of `num_nodes` nodes x `num_gpus` slots (tests/test_launch.py compares
    the two), instead of the runner, which imports all of DeepSpeed only to write that line. None when
    `launcher.extra_args` holds a runner-only option: then every node runs the runner."""
    hosts = {f"node{i}": list(range(per_node(ln))) for i in range(ln.num_nodes)}
    env = checked_env(ln.env)
    plan = LaunchPlan([], requires=[_needs_deepspeed()])
    for node in range(ln.num_nodes):
        args = deepspeed_node_args(hosts, port, ln.extra_args, worker_module, ["--run-dir", str(run_dir)],
                                   master_addr=ln.master_addr, node_rank=node, kind=ln.kind)
        if args is None:
            return None
        plan.commands.append(_node_launcher(args, dict(env), node_rank=node))
    plan.notes.append(
        "run command N on node N (all at once); this machine runs the one for launcher.node_rank. Each is DeepSpeed's "
        "per-node launcher with what `deepspeed --no_ssh --node_rank N` would start it with; launcher.env is exported "
        "to each command"
    )
    return plan


def _build_torchrun(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    ln = cfg.launcher
    endpoint = ln.rdzv_endpoint or f"{ln.master_addr}:{port}"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(per_node(ln))]
    argv += ["--nnodes", str(ln.num_nodes), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint]
    extra = checked_extra_args(ln.kind, ln.extra_args)
    argv += ["--rdzv_id", f"dsrecipes-{run_dir.name}", *extra, *_worker_args(worker_module, run_dir)]
    env = {**torchrun_shutdown(cfg.trainer.stop_grace_s, environ), **checked_env(ln.env)}  # (every node's command)
    plan = LaunchPlan([Command(argv, env)])
    if ln.num_nodes > 1:
        plan.notes.append("multi-node torchrun: run this same command on every node; c10d assigns node ranks")
    return plan


def _build_mpirun(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    ln = cfg.launcher
    nprocs = per_node(ln) * ln.num_nodes
    argv = ["mpirun", "-np", str(nprocs)]
    if ln.hostfile:
        argv += ["--hostfile", _hostfile(ln.hostfile)]
    # Each rank runs our shim: DeepSpeed's own mpi4py discovery (with our port), then the worker module.
    extra = checked_extra_args(ln.kind, ln.extra_args)
    argv += [*extra, sys.executable, "-m", "dsrecipes.run.launch.mpi_rank", "--master-port", str(port)]
    if ln.num_nodes == 1 or ln.master_addr != LauncherConfig().master_addr:
        argv += ["--master-addr", ln.master_addr]
    # forwarded as arguments: MPI implementations export the environment differently
    for key, value in sorted(checked_env(ln.env).items()):
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




BUILDERS: Dict[LauncherKind, Callable[..., LaunchPlan]] = {
    LauncherKind.local: _build_local,
    LauncherKind.deepspeed: _build_deepspeed,
    LauncherKind.deepspeed_multinode: _build_deepspeed_multinode,
    LauncherKind.torchrun: _build_torchrun,
    LauncherKind.mpirun: _build_mpirun,
    LauncherKind.slurm: build_slurm,
}


def resolve_master_port(cfg: TrainConfig) -> int:
    """launcher.master_port, or when it is null: a free port for a single-node run (concurrent runs never collide),
    DeepSpeed's default 29500 for a multi-node run (every node must agree on it)."""
    ln = cfg.launcher
    if ln.master_port is not None:
        return ln.master_port
    single = ln.num_nodes == 1 and ln.kind not in (LauncherKind.slurm, LauncherKind.deepspeed_multinode)
    return free_port() if single and not ln.hostfile else MULTINODE_DEFAULT_PORT
