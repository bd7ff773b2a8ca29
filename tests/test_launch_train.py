"""End-to-end 2-rank CPU training through launchers other than deepspeed (which test_train_runs.py covers).

The same config must train identically whoever starts the ranks: torchrun and mpirun give the same losses.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.util import find_spec

import pytest

pytestmark = pytest.mark.slow


def train(kind: str, tmp_path) -> list:
    from tests.conftest import subprocess_env

    run_dir = tmp_path / kind
    args = [
        sys.executable, "-m", "dsrecipes", "debug=fast", f"launcher={kind}", "launcher.num_gpus=2", "trainer.max_steps=2",
        "scheduler.warmup_steps=1", "trainer.export=false", "trainer.log_every=1", f"trainer.output_dir={run_dir}",
    ]  # fmt: skip
    done = subprocess.run(args, env=subprocess_env(), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "--run-dir" in (run_dir / "launch.txt").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 2 * ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
    return [r["loss"] for r in rows if "loss" in r]


def test_torchrun_and_mpirun_train_the_same(tmp_path):
    losses = {"torchrun": train("torchrun", tmp_path)}
    assert len(losses["torchrun"]) == 2
    if shutil.which("mpirun") and find_spec("mpi4py"):
        losses["mpirun"] = train("mpirun", tmp_path)
        assert losses["mpirun"] == pytest.approx(losses["torchrun"], rel=1e-6)
