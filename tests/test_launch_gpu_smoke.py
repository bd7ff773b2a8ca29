"""benchmarks/gpu_smoke.py: its configs compose, and its direct mode runs end to end on CPU with a tiny model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_smoke.py"


def load_smoke():
    if str(SCRIPT.parent) not in sys.path:  # its _harness sits beside it, as when it runs as a script
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stage", [2, 3])
def test_pipeline_overrides_compose(make_cfg, tmp_path, stage):
    smoke = load_smoke()
    args = smoke.parse_args(["--out", str(tmp_path), "--override", "optimizer.torch_adam=false"])
    cfg = make_cfg(*smoke.pipeline_overrides(args, stage, tmp_path / "run"), check_files=False)
    assert cfg.zero.stage == stage and cfg.model.tiny.hidden_size == 896 and cfg.data.packing
    assert cfg.optimizer.torch_adam is False and cfg.trainer.micro_batch_size == 16  # --override, the default batch
    from dsrecipes.core.topology import resolve_topology

    assert resolve_topology(cfg.launcher).world_size == 1


def test_qwen_shape_is_half_a_billion():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**load_smoke().QWEN2_0_5B))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768


@pytest.mark.slow
def test_direct_mode_on_cpu(tmp_path):
    from tests.conftest import subprocess_env

    argv = [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--modes", "direct", "--stages", "2", "--tiny",
            "--device", "cpu", "--steps", "16", "--warmup", "2", "--micro-batch", "2", "--seq", "64",
            "--override", "optimizer.weight_decay=0.0"]  # fmt: skip
    done = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "results.json").read_text())
    (phase,) = result["results"]
    assert phase["ok"] and phase["tokens_per_s"] > 0 and 0 < phase["mfu"] < 1
    # the override reached the direct child's DeepSpeed JSON: torch's AdamW (dsrecipes' default) under ZeRO-2
    assert phase["overrides"] == ["optimizer.weight_decay=0.0"] and phase["ds_optimizer"]["params"]["weight_decay"] == 0
    assert phase["optimizer"] == "AdamW in DeepSpeedZeroOptimizer"
    assert "PASS" in done.stdout
    log = (tmp_path / "direct_stage2.log").read_text()  # on CPU, as dsrecipes ranks: no shared-memory comm op
    assert "shm_comm" not in log, log[-2000:]
