"""Launchers: golden argv for every LauncherKind, checked by the launchers' own parsers; dry-run; env handling.

Real multi-process runs (a probe module stands in for the worker) are in test_launch_real.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.core.errors import UserError
from dsrecipes.core.schema import LauncherKind
from dsrecipes.core.topology import resolve_topology
from dsrecipes.run import launch
from dsrecipes.run.launch.builders import MULTINODE_DEFAULT_PORT
from dsrecipes.run.launch.plan import render_plan
from dsrecipes.run.launch.process import child_env, run_subprocess

PY = sys.executable
RUN = Path("/tmp/dsr-run")
PORT = 12345


def world_size(cfg) -> int:
    return resolve_topology(cfg.launcher).world_size


def plan_for(make_cfg, *overrides, environ=None, **kw):
    cfg = make_cfg(*overrides, check_files=False)
    return cfg, launch.build_plan(cfg, RUN, master_port=PORT, environ=environ or {}, **kw)


def test_every_kind_has_a_builder():
    assert set(launch.BUILDERS) == set(LauncherKind)
    assert len(launch.BUILDERS) > 0


def test_every_launcher_option_composes_and_builds(make_cfg):
    from dsrecipes.core.paths import conf_dir

    options = sorted(p.stem for p in (conf_dir() / "launcher").glob("*.yaml"))
    assert options, "no conf/launcher/*.yaml found"
    for option in options:
        cfg, plan = plan_for(make_cfg, f"launcher={option}")
        assert plan.commands, option
        assert all(isinstance(a, str) for c in plan.commands for a in c.argv), option


# --- golden argv ------------------------------------------------------------------------------------------------


def test_local_golden(make_cfg):
    cfg, plan = plan_for(make_cfg, "launcher=local")
    (cmd,) = plan.commands
    assert cmd.in_process
    assert cmd.argv == [PY, "-m", "dsrecipes.rank.worker", "--run-dir", str(RUN)]
    assert cmd.env == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(PORT),
    }


def test_deepspeed_golden(make_cfg):
    """One machine: DeepSpeed's per-node launcher, started as DeepSpeed's runner would start it."""
    cfg, plan = plan_for(make_cfg, "launcher=deepspeed", "launcher.num_gpus=2")
    (cmd,) = plan.commands
    assert cmd.argv == [
        PY, "-u", "-m", "dsrecipes.run.launch.ds_node", "--world_info=eyJsb2NhbGhvc3QiOiBbMCwgMV19",
        "--master_addr=127.0.0.1", f"--master_port={PORT}", "--module", "--no_local_rank", "--log_level=info",
        "dsrecipes.rank.worker", "--run-dir", str(RUN),
    ]  # fmt: skip
    assert cmd.env == {} and cmd.node_rank is None and not plan.files
    assert "deepspeed" in [r.name for r in plan.requires]


def _node_launch_parse(monkeypatch, argv):
    from deepspeed.launcher import launch as ds_launch

    monkeypatch.setattr(sys, "argv", ["launch.py", *argv])
    return ds_launch.parse_args()


def _runner_command(monkeypatch, runner_argv):
    """The command DeepSpeed's runner itself starts for `runner_argv` (its main(), with Popen recording)."""
    from deepspeed.launcher import runner

    started, real_popen = [], subprocess.Popen

    class Recorded:
        returncode = 0

        def __new__(cls, cmd, *args, **kwargs):
            if "deepspeed.launcher.launch" not in cmd:  # its probes (numactl) run
                return real_popen(cmd, *args, **kwargs)
            started.append(cmd)
            return super().__new__(cls)

        def __init__(self, *args, **kwargs):
            pass

        def wait(self):
            return 0

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(subprocess, "Popen", Recorded)
    runner.main(runner_argv)
    (cmd,) = started
    return cmd


@pytest.mark.parametrize("extra", [[], ["--bind_cores_to_rank", "--bind_core_list=0-3", "--log_level", "warning"],
                                   ["--quiet"]])
def test_deepspeed_single_node_is_what_the_runner_starts(make_cfg, monkeypatch, extra):
    """Ours is the command DeepSpeed's runner starts for the same run (its main(), Popen recorded): the per-node
    launcher's own parser reads both alike, and they differ only by a default the runner spells out."""
    quoted = ",".join(repr(a) for a in extra)
    cfg, plan = plan_for(make_cfg, "launcher=deepspeed", "launcher.num_gpus=3", f"launcher.extra_args=[{quoted}]")
    (cmd,) = plan.commands
    runner_argv = ["--num_gpus", "3", "--master_port", str(PORT), *extra, "--no_local_rank", "--module",
                   "dsrecipes.rank.worker", "--run-dir", str(RUN)]
    theirs = _runner_command(monkeypatch, runner_argv)
    assert theirs[:4] == [PY, "-u", "-m", "deepspeed.launcher.launch"]
    assert cmd.argv[:4] == [PY, "-u", "-m", "dsrecipes.run.launch.ds_node"]  # which runs that module's main()
    ours = _node_launch_parse(monkeypatch, cmd.argv[4:])
    assert vars(ours) == vars(_node_launch_parse(monkeypatch, theirs[4:]))
    assert [a for a in theirs[4:] if a not in cmd.argv] == ["--enable_each_rank_log=None"]  # (a default, spelled out)
    assert (ours.training_script, ours.training_script_args) == ("dsrecipes.rank.worker", ["--run-dir", str(RUN)])
    assert (ours.module, ours.no_local_rank, ours.no_python, ours.master_port) == (True, True, False, PORT)


def test_the_node_entry_is_deepspeeds_launcher_without_mlflow():
    """`python -m dsrecipes.run.launch.ds_node` is DeepSpeed's per-node launcher (its own parser and main()), and its
    process never imports mlflow although mlflow is installed (DeepSpeed's autotuner would import it)."""
    pytest.importorskip("mlflow")
    probe = ("import sys\nfrom dsrecipes.run.launch import ds_node\nsys.argv = ['ds_node', '--help']\n"
             "try:\n    ds_node.main()\nexcept SystemExit as e:\n    print('exit', e.code)\n"
             "print('mlflow' in sys.modules, sys.modules['deepspeed.launcher.launch'].__file__)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**child_env({}), "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr
    assert "--world_info" in done.stdout and "--no_local_rank" in done.stdout  # DeepSpeed's launcher's own help
    *_, exited, last = done.stdout.strip().splitlines()
    assert exited == "exit 0" and last.startswith("False ") and last.endswith("deepspeed/launcher/launch.py"), last


@pytest.mark.parametrize("overrides, environ", [
    (["launcher.extra_args=[--ssh_port,'2222']"], {}),  # an option of the runner's ssh path
    (["launcher.extra_args=[--force_multi]"], {}),
    (["launcher.num_gpus=null", "launcher.include=localhost:1"], {}),  # the runner resolves the selection
    (["launcher.num_gpus=null"], {"CUDA_VISIBLE_DEVICES": "1,2"}),  # ... and turns this into --include
])
def test_deepspeed_runner_stays_where_it_resolves_more(make_cfg, overrides, environ):
    if not any("num_gpus" in o for o in overrides):
        overrides = ["launcher.num_gpus=2", *overrides]
    _, plan = plan_for(make_cfg, "launcher=deepspeed", *overrides, environ=environ)
    assert plan.commands[0].argv[1:3] == ["-m", "deepspeed.launcher.runner"]


def test_deepspeed_include_hostfile_golden(make_cfg, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=4\n")
    cfg, plan = plan_for(
        make_cfg, "launcher=deepspeed", "launcher.num_gpus=null", f"launcher.hostfile={hostfile}",
        "launcher.include='worker-0:0,1@worker-1:2'", "launcher.master_addr=10.0.0.1", "launcher.num_nodes=2",
        "+launcher.env.NCCL_DEBUG=INFO", "launcher.extra_args=[--bind_cores_to_rank]",
    )  # fmt: skip
    (cmd,) = plan.commands
    assert cmd.argv == [
        PY, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--include", "worker-0:0,1@worker-1:2",
        "--master_addr", "10.0.0.1", "--master_port", str(PORT), "--bind_cores_to_rank",
        "--no_local_rank", "--module", "dsrecipes.rank.worker", "--run-dir", str(RUN),
    ]  # fmt: skip
    # pdsh multi-node reads .deepspeed_env; DS_ENV_FILE points DeepSpeed at the run's own copy
    assert plan.files[".deepspeed_env"] == "NCCL_DEBUG=INFO\n"
    assert cmd.env == {"NCCL_DEBUG": "INFO", "DS_ENV_FILE": str(RUN / ".deepspeed_env")}
    assert "pdsh" in [r.name for r in plan.requires]
    assert world_size(cfg) == 3  # DeepSpeed's own hostfile/include parsing


def test_pdsh_nodes_get_the_store_settings_never_the_secrets(make_cfg, tmp_path):
    """DeepSpeed's pdsh runner forwards only PYTHON*/MLFLOW*/MV2*/UCX* names: the object-store endpoint, region and
    profile of the launching environment go to the other nodes through .deepspeed_env (plain URLs and names only:
    DeepSpeed writes that file into a shell command); keys and tokens never do, and the plan says so."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    environ = {"AWS_ENDPOINT_URL": "http://10.213.0.101:9000", "AWS_REGION": "us-east-1", "AWS_PROFILE": "$(reboot)",
               "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3cr3t", "HF_TOKEN": "hf_x"}
    _, plan = plan_for(make_cfg, "launcher=deepspeed", "launcher.num_gpus=null", f"launcher.hostfile={hostfile}",
                       "launcher.num_nodes=2", environ=environ)
    assert plan.files[".deepspeed_env"] == "AWS_ENDPOINT_URL=http://10.213.0.101:9000\nAWS_REGION=us-east-1\n"
    notes = "\n".join(plan.notes)
    assert "AWS_PROFILE is not passed to the other nodes" in notes  # not a plain name: stays behind, said
    assert "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, HF_TOKEN stay on this node" in notes
    assert "s3cr3t" not in notes + str(plan.files) and "hf_x" not in notes + str(plan.files)


def test_deepspeed_argv_parsed_by_deepspeed(make_cfg, monkeypatch):
    from deepspeed.launcher.runner import encode_world_info

    cfg, plan = plan_for(make_cfg, "launcher=deepspeed", "launcher.num_gpus=3")
    args = _node_launch_parse(monkeypatch, plan.commands[0].argv[4:])
    assert args.world_info == encode_world_info({"localhost": [0, 1, 2]})
    assert (args.master_addr, args.master_port, args.module, args.no_local_rank) == ("127.0.0.1", PORT, True, True)
    assert args.training_script == "dsrecipes.rank.worker"
    assert args.training_script_args == ["--run-dir", str(RUN)]


def test_deepspeed_multinode_golden(make_cfg):
    """No hostfile: on node N, DeepSpeed's per-node launcher with what `deepspeed --no_ssh --node_rank N` gives it."""
    cfg, plan = plan_for(
        make_cfg, "launcher=deepspeed_multinode", "launcher.master_addr=10.1.2.3", "launcher.master_port=29600"
    )
    assert [c.node_rank for c in plan.commands] == [0, 1]
    world = "eyJub2RlMCI6IFswLCAxLCAyLCAzLCA0LCA1LCA2LCA3XSwgIm5vZGUxIjogWzAsIDEsIDIsIDMsIDQsIDUsIDYsIDddfQ=="
    for node, cmd in enumerate(plan.commands):
        assert cmd.argv == [
            PY, "-u", "-m", "dsrecipes.run.launch.ds_node", f"--world_info={world}", "--master_addr=10.1.2.3",
            f"--master_port={PORT}", f"--node_rank={node}", "--module", "--no_local_rank", "--log_level=info",
            "dsrecipes.rank.worker", "--run-dir", str(RUN),
        ]  # fmt: skip
        assert cmd.env == {"NCCL_IB_DISABLE": "0"}  # launcher.env, exported directly (no-ssh ignores .deepspeed_env)
    assert not plan.files  # no hostfile: nothing reads one
    assert world_size(cfg) == 16


@pytest.mark.parametrize("extra", [[], ["--bind_cores_to_rank", "--log_level", "warning"], ["--quiet"]])
def test_deepspeed_multinode_node_is_what_the_no_ssh_runner_starts(make_cfg, monkeypatch, tmp_path, extra):
    """Node N's command is the one DeepSpeed's runner starts on node N in --no_ssh mode, for a hostfile of
    num_nodes x num_gpus (its main(), Popen recorded): the per-node launcher's parser reads both alike."""
    quoted = ",".join(repr(a) for a in extra)
    cfg, plan = plan_for(make_cfg, "launcher=deepspeed_multinode", "launcher.num_nodes=3", "launcher.num_gpus=2",
                         "launcher.master_addr=10.1.2.3", f"launcher.extra_args=[{quoted}]")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\nnode2 slots=2\n")
    for cmd in plan.commands:
        runner_argv = ["--hostfile", str(hostfile), "--num_nodes", "3", "--num_gpus", "2", "--no_ssh", "--node_rank",
                       str(cmd.node_rank), "--master_addr", "10.1.2.3", "--master_port", str(PORT), *extra,
                       "--no_local_rank", "--module", "dsrecipes.rank.worker", "--run-dir", str(RUN)]
        theirs = _runner_command(monkeypatch, runner_argv)
        assert theirs[:4] == [PY, "-u", "-m", "deepspeed.launcher.launch"]
        assert cmd.argv[:4] == [PY, "-u", "-m", "dsrecipes.run.launch.ds_node"]
        ours = _node_launch_parse(monkeypatch, cmd.argv[4:])
        assert vars(ours) == vars(_node_launch_parse(monkeypatch, theirs[4:]))
        assert [a for a in theirs[4:] if a not in cmd.argv] == ["--enable_each_rank_log=None"]
        assert (ours.node_rank, ours.master_addr) == (cmd.node_rank, "10.1.2.3")
        assert ours.training_script == "dsrecipes.rank.worker"
    assert world_size(cfg) == 6


def test_deepspeed_multinode_runner_stays_for_a_hostfile_or_a_runner_option(make_cfg, tmp_path):
    """A hostfile of the user's (the runner resolves it, with --include/--exclude) or a runner-only option (here
    --ssh_port) keep DeepSpeed's runner on every node, as `deepspeed --no_ssh --node_rank N`."""
    from deepspeed.launcher.runner import parse_args

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=8\nworker-1 slots=8\n")
    for overrides in ([f"launcher.hostfile={hostfile}"], ["launcher.extra_args=[--ssh_port,'2222']"]):
        cfg, plan = plan_for(make_cfg, "launcher=deepspeed_multinode", *overrides)
        for node, cmd in enumerate(plan.commands):
            assert cmd.argv[1:3] == ["-m", "deepspeed.launcher.runner"]
            args = parse_args(cmd.argv[3:])
            assert (args.no_ssh, args.node_rank, args.num_nodes, args.num_gpus) == (True, node, 2, 8)
    assert plan.files["hostfile"].splitlines()[1:] == ["node0 slots=8", "node1 slots=8"]  # the runner's node list


def test_torchrun_golden(make_cfg):
    cfg, plan = plan_for(make_cfg, "launcher=torchrun")
    (cmd,) = plan.commands
    assert cmd.argv == [
        PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", f"127.0.0.1:{PORT}", "--rdzv_id", "dsrecipes-dsr-run",
        "-m", "dsrecipes.rank.worker", "--run-dir", str(RUN),
    ]  # fmt: skip
    assert world_size(cfg) == 2
    # torchrun's 30 s before it SIGKILLs its ranks after a stop signal, past trainer.stop_grace_s (60 s): in the
    # command itself, so launch.txt's line gives it to every node (was: set at run time on the launching node only)
    assert cmd.env == {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "70"}
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=70 " in render_plan("torchrun", plan)
    (exported,) = plan_for(make_cfg, "launcher=torchrun", environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"})[1].commands
    assert exported.env == {}  # the user's own value stands


def test_torchrun_multinode_endpoint(make_cfg):
    cfg, plan = plan_for(
        make_cfg,
        "launcher=torchrun",
        "launcher.num_nodes=4",
        "launcher.num_gpus=8",
        "launcher.rdzv_endpoint=head:29400",
    )
    argv = plan.commands[0].argv
    assert argv[argv.index("--rdzv_endpoint") + 1] == "head:29400"
    assert argv[argv.index("--nnodes") + 1] == "4"
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv[3:])
    assert (args.nproc_per_node, args.module, args.training_script) == ("8", True, "dsrecipes.rank.worker")
    assert args.training_script_args == ["--run-dir", str(RUN)]
    assert world_size(cfg) == 32


def test_mpirun_golden(make_cfg):
    cfg, plan = plan_for(make_cfg, "launcher=mpirun", "+launcher.env.NCCL_SOCKET_IFNAME='eth0,ib0'")
    (cmd,) = plan.commands
    assert cmd.argv == [
        "mpirun", "-np", "2", PY, "-m", "dsrecipes.run.launch.mpi_rank", "--master-port", str(PORT),
        "--master-addr", "127.0.0.1", "--env", "NCCL_SOCKET_IFNAME=eth0,ib0", "--module", "dsrecipes.rank.worker",
        "--", "--run-dir", str(RUN),
    ]  # fmt: skip
    assert {r.name for r in plan.requires} == {"mpirun", "mpi4py"}


def test_slurm_golden(make_cfg):
    cfg, plan = plan_for(
        make_cfg, "launcher=slurm", "launcher.slurm_account=proj", "launcher.slurm_sbatch_args=['--qos=high']",
        "launcher.slurm_venv=/venv", "launcher.slurm_modules=[cuda/12.1,gcc/11.2.0]", "+launcher.env.NCCL_DEBUG=WARN",
    )  # fmt: skip
    (cmd,) = plan.commands
    assert cmd.argv == ["sbatch", str(RUN / "launch.sbatch")]
    script = plan.files["launch.sbatch"]
    for line in (
        "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8", "#SBATCH --time=240",
        "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --qos=high", "source /venv/bin/activate",
        "module load cuda/12.1", "module load gcc/11.2.0",
        "export NCCL_DEBUG=WARN", f"MASTER_PORT={PORT}",
    ):  # fmt: skip
        assert line in script.splitlines(), line
    assert "--node_rank $SLURM_NODEID" in script and "--no_ssh" in script
    assert world_size(cfg) == 16


# --- behaviour --------------------------------------------------------------------------------------------------


def test_free_port_only_for_an_unset_single_node_port(make_cfg):
    cfg = make_cfg("launcher=deepspeed", check_files=False)
    assert cfg.launcher.master_port is None  # null: pick a free one
    ports = {launch.resolve_master_port(cfg) for _ in range(3)}
    assert MULTINODE_DEFAULT_PORT not in ports and len(ports) > 1
    assert (
        launch.resolve_master_port(make_cfg("launcher=deepspeed", "launcher.master_port=29777", check_files=False))
        == 29777
    )
    multi = make_cfg("launcher=deepspeed_multinode", check_files=False)
    assert launch.resolve_master_port(multi) == MULTINODE_DEFAULT_PORT  # every node must agree


def test_cuda_visible_devices_warning(make_cfg):
    _, plan = plan_for(make_cfg, "launcher=deepspeed", "launcher.num_gpus=2", environ={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert any("CUDA_VISIBLE_DEVICES=2,3 is ignored" in w for w in plan.warnings)
    _, plan = plan_for(make_cfg, "launcher=deepspeed", environ={"CUDA_VISIBLE_DEVICES": "2"})
    assert plan.warnings == []  # without --num_gpus the runner turns it into --include itself


def test_dry_run_writes_launch_txt_and_runs_nothing(make_cfg, tmp_path, capsys):
    cfg = make_cfg("launcher=mpirun", "launcher.dry_run=true", check_files=False)
    assert launch.launch(cfg, tmp_path) == 0  # mpirun is absent here: a dry run must not care
    text = (tmp_path / "launch.txt").read_text()
    assert "mpirun -np 2" in text and text == capsys.readouterr().out


def test_dry_run_slurm_writes_script(make_cfg, tmp_path):
    cfg = make_cfg("launcher=slurm", "launcher.dry_run=true", check_files=False)
    assert launch.launch(cfg, tmp_path) == 0
    assert (tmp_path / "launch.sbatch").read_text().startswith("#!/bin/bash")
    assert f"sbatch {tmp_path / 'launch.sbatch'}" in (tmp_path / "launch.txt").read_text()


@pytest.mark.parametrize("kind,missing", [("mpirun", "mpirun"), ("slurm", "sbatch")])
def test_missing_tool_is_a_user_error(make_cfg, tmp_path, monkeypatch, kind, missing):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    cfg = make_cfg(f"launcher={kind}", check_files=False)
    with pytest.raises(UserError) as err:
        launch.launch(cfg, tmp_path)
    assert f"{missing} not found" in str(err.value) and err.value.exit_code == 2


def test_local_runs_worker_in_process_and_restores_env(make_cfg, tmp_path, monkeypatch):
    seen = {}

    def run(run_dir):
        import os

        seen.update({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")})
        seen["run_dir"] = run_dir
        return 0

    import dsrecipes.rank.worker

    monkeypatch.setattr(dsrecipes.rank.worker, "run", run)
    monkeypatch.setenv("RANK", "7")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    cfg = make_cfg("launcher=local", check_files=False)
    assert launch.launch(cfg, tmp_path) == 0
    assert seen["RANK"] == "0" and seen["WORLD_SIZE"] == "1" and seen["MASTER_ADDR"] == "127.0.0.1"
    assert int(seen["MASTER_PORT"]) != MULTINODE_DEFAULT_PORT
    assert Path(seen["run_dir"]) == tmp_path.resolve()
    import os

    assert os.environ["RANK"] == "7" and "MASTER_PORT" not in os.environ
    assert (tmp_path / "launch.txt").is_file()


def test_child_env_drops_inherited_rank_variables(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "1")
    env = child_env({"FOO": "1"})
    assert "RANK" not in env and "MASTER_PORT" not in env and env["FOO"] == "1"


def test_shell_rendering_quotes():
    cmd = launch.Command(["a b", "c"], {"X": "1 2"})
    assert cmd.shell() == "X='1 2' 'a b' c"


def test_sigterm_is_forwarded_to_the_launcher(tmp_path):
    import os
    import signal
    import threading
    import time

    marker = tmp_path / "got-term"
    child = tmp_path / "child.py"
    child.write_text(
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).write_text('x'), sys.exit(3)))\n"
        "time.sleep(30)\n"
    )
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    start = time.time()
    code = run_subprocess(launch.Command([sys.executable, str(child)]), tmp_path, grace_s=10)
    assert code == 3 and marker.is_file() and time.time() - start < 20
    assert signal.getsignal(signal.SIGTERM) is before
    from dsrecipes.core import stopping

    assert stopping.requested() == signal.SIGTERM
    stopping.reset()


def test_a_launcher_that_ignores_sigterm_is_killed_with_its_tree_after_the_grace(tmp_path):
    """No orphans: a launcher and its child that both ignore SIGTERM (a rank stuck where no step boundary comes)
    are killed once `grace_s` has passed; the grandchild, reparented when its parent dies, goes too."""
    import os
    import signal
    import threading
    import time

    import psutil

    pids = tmp_path / "pids"
    child = tmp_path / "child.py"
    child.write_text(
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{kid.pid}}')\n"
        "time.sleep(60)\n"
    )
    threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    start = time.time()
    code = run_subprocess(launch.Command([sys.executable, str(child)]), tmp_path, grace_s=2)
    assert code == -signal.SIGKILL and time.time() - start < 15
    for pid in map(int, pids.read_text().split()):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    from dsrecipes.core import stopping

    stopping.reset()
