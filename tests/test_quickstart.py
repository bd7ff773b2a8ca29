"""The README's first command: `python -m dsrecipes` with no arguments trains, falls, exports, and beats its start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsrecipes.rundir import read_metrics
from tests.conftest import subprocess_env

pytestmark = pytest.mark.slow


def test_default_run_trains_exports_and_beats_its_start(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dsrecipes"], cwd=tmp_path, env=subprocess_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    (run_dir,) = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    rows = read_metrics(run_dir)
    train = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert train[-1] < 0.3 * train[0], train
    assert len(evals) >= 4 and evals == sorted(evals, reverse=True) and evals[-1] < 0.7 * evals[0], evals
    for name in ("config.yaml", "ds_config.json", "launch.txt", "result.json", "loss.png", "export/model.safetensors",
                 "export_init/config.json", "checkpoints/latest"):
        assert (run_dir / name).exists(), name
    assert json.loads((run_dir / "result.json").read_text())["status"] == "ok"

    scores = tmp_path / "scores.json"
    pe = subprocess.run([sys.executable, "-m", "dsrecipes", "prompt-eval", "--baseline", str(run_dir / "export_init"),
                         "--finetuned", str(run_dir / "export"), "--json", str(scores)],
                        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert pe.returncode == 0, pe.stderr[-3000:]
    assert "baseline" in pe.stdout and "finetuned" in pe.stdout
    s = json.loads(scores.read_text())
    assert s["finetuned"]["similarity"] > s["baseline"]["similarity"] + 0.3
    assert s["finetuned"]["reference_loss"] < s["baseline"]["reference_loss"] / 2
