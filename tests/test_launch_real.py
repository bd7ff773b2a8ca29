"""Real 2-rank CPU launches of the commands our builders produce, with a probe module standing in for the worker.

The probe (tests/test_launch_probe.py) checks the env:// variables, all_reduces over gloo and writes one JSON per
rank; these tests prove that the argv each launcher kind builds starts a working process group.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from dsrecipes.core.distributed import free_port
from dsrecipes.core.topology import resolve_topology
from dsrecipes.run import launch

TESTS = Path(__file__).resolve().parent
PROBE = "test_launch_probe"
pytestmark = pytest.mark.slow


@pytest.fixture
def probe_env(monkeypatch):
    from tests.conftest import subprocess_env

    env = subprocess_env({"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])})
    for key in list(os.environ):
        if key not in env:
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return env


def probe_results(run_dir: Path, world: int):
    files = sorted((run_dir / "probe").glob("rank*.json"))
    records = [json.loads(f.read_text()) for f in files]
    assert [r["rank"] for r in records] == list(range(world)), records
    for r in records:
        assert r["world_size"] == world
        assert r["sum"] == world * (world + 1) / 2
        assert r["argv"] == ["--run-dir", str(run_dir)]  # no --local_rank appended
        assert r["env"]["NCCL_IB_TIMEOUT"] == "23"  # launcher.env (a documented name) on every rank
    return records


@pytest.mark.parametrize("kind", ["deepspeed", "torchrun"])
def test_two_ranks_on_this_machine(make_cfg, tmp_path, probe_env, kind):
    cfg = make_cfg(
        f"launcher={kind}", "launcher.num_gpus=2", "+launcher.env.NCCL_IB_TIMEOUT=23", check_files=False
    )
    assert resolve_topology(cfg.launcher).world_size == 2
    assert launch.launch(cfg, tmp_path, worker_module=PROBE) == 0
    records = probe_results(tmp_path.resolve(), 2)
    assert {r["env"]["LOCAL_RANK"] for r in records} == {"0", "1"}
    assert records[0]["env"]["MASTER_PORT"] != "29500"  # a free port was picked


def test_failing_rank_exit_code_propagates(make_cfg, tmp_path, probe_env):
    cfg = make_cfg("launcher=torchrun", "launcher.num_gpus=1", check_files=False)
    assert launch.launch(cfg, tmp_path, worker_module="no_such_module_dsr") != 0


def test_no_ssh_multinode_two_nodes_on_localhost(make_cfg, tmp_path, probe_env):
    cfg = make_cfg(
        "launcher=deepspeed_multinode", "launcher.num_gpus=1", "launcher.num_nodes=2",
        f"launcher.master_port={free_port()}", "+launcher.env.NCCL_IB_TIMEOUT=23",
    )  # fmt: skip
    run_dir = tmp_path.resolve()
    plan = launch.build_plan(cfg, run_dir, worker_module=PROBE)
    for name, content in plan.files.items():
        (run_dir / name).write_text(content)
    procs = [subprocess.Popen(c.argv, env={**probe_env, **c.env}) for c in plan.commands]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    records = probe_results(run_dir, 2)
    assert [r["env"]["LOCAL_RANK"] for r in records] == ["0", "0"]  # one rank per "node"


def test_slurm_script_with_fake_srun(make_cfg, tmp_path, probe_env):
    """Run the generated sbatch script with stand-ins for scontrol/srun: 2 "nodes" x 1 rank on this machine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        # scontrol show hostnames <list>: one line per node; the first is the master address
        "scontrol": "#!/bin/bash\nprintf 'localhost\\nfakenode1\\n'\n",
        # srun ... bash -c CMD: start one task per node with its SLURM_NODEID, fail if any fails
        "srun": "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\npids=()\n"
        'for n in 0 1; do SLURM_NODEID=$n "$@" & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait $p || rc=1; done; exit $rc\n',
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    cfg = make_cfg(
        "launcher=slurm", "launcher.num_gpus=1", "launcher.num_nodes=2", f"launcher.master_port={free_port()}",
        "+launcher.env.NCCL_IB_TIMEOUT=23",
    )  # fmt: skip
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = launch.build_plan(cfg, run_dir, worker_module=PROBE)
    script = run_dir / "launch.sbatch"
    script.write_text(plan.files["launch.sbatch"])
    env = {**probe_env, "PATH": f"{bin_dir}{os.pathsep}{probe_env['PATH']}", "SLURM_JOB_NODELIST": "fake[0-1]",
           "SLURM_JOB_ID": "42"}  # fmt: skip
    done = subprocess.run(["bash", str(script)], env=env, timeout=240)
    assert done.returncode == 0
    probe_results(run_dir.resolve(), 2)
    assert (run_dir / "hostfile.42").read_text() == "localhost slots=1\nfakenode1 slots=1\n"


def test_mpirun_two_ranks(make_cfg, tmp_path, probe_env):
    import shutil
    from importlib.util import find_spec

    if shutil.which("mpirun") is None or find_spec("mpi4py") is None:
        pytest.skip("needs mpirun and mpi4py (pip install mpi4py mpich)")
    cfg = make_cfg("launcher=mpirun", "launcher.num_gpus=2", "+launcher.env.NCCL_IB_TIMEOUT=23")
    assert launch.launch(cfg, tmp_path, worker_module=PROBE) == 0
    probe_results(tmp_path.resolve(), 2)
