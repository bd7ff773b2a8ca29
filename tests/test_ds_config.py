"""build_ds_config(): golden values, and every zero x offload x precision through DeepSpeed's own parser."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.core.distributed import free_port
from dsrecipes.run.ds_config import build_ds_config
from tests.conftest import subprocess_env

HELPER = Path(__file__).parent / "helpers" / "check_ds_configs.py"


def _no_auto(node):
    if isinstance(node, dict):
        return all(_no_auto(v) for v in node.values())
    if isinstance(node, list):
        return all(_no_auto(v) for v in node)
    return node != "auto"


def test_golden_zero3_cpu_offload_bf16(make_cfg):
    cfg = make_cfg("zero=stage3", "offload=cpu_optimizer_params", "precision=bf16", "trainer.micro_batch_size=2",
                   "optimizer.lr=1e-3",
                   "trainer.grad_accum=4", "trainer.max_steps=100", "scheduler=linear", check_files=False)
    assert build_ds_config(cfg, 8) == {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "seed": 42,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-08,
                                                  "weight_decay": 0.01, "torch_adam": False}},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 50000000,
            "stage3_prefetch_bucket_size": 50000000, "stage3_param_persistence_threshold": 100000,
            "stage3_max_live_parameters": 1000000000, "stage3_gather_16bit_weights_on_model_save": True,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
        "bf16": {"enabled": True},
    }


def test_load_universal_for_elastic_resume(make_cfg):
    cfg = make_cfg("zero=stage2", check_files=False)
    assert "checkpoint" not in build_ds_config(cfg, 2)
    assert build_ds_config(cfg, 2, load_universal=True)["checkpoint"] == {"load_universal": True}


def test_golden_default_and_fp16(make_cfg):
    cfg = make_cfg("precision=fp16", "zero=stage2", "scheduler=constant", "optimizer.lr=1e-3", check_files=False)
    ds = build_ds_config(cfg, 2)
    assert ds["train_batch_size"] == cfg.trainer.micro_batch_size * cfg.trainer.grad_accum * 2
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    assert "bf16" not in ds
    assert "scheduler" not in ds  # the LR schedule is ours (dsrecipes.rank.schedule), not DeepSpeed's
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                       "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000}


def test_optimizers(make_cfg):
    sgd = build_ds_config(make_cfg("optimizer=sgd", "zero=stage1", check_files=False), 1)
    assert sgd["optimizer"] == {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}}
    assert sgd["zero_allow_untested_optimizer"] is True
    lion = build_ds_config(make_cfg("optimizer=lion", check_files=False), 1)
    assert lion["optimizer"]["type"] == "Lion" and "zero_allow_untested_optimizer" not in lion
    adam = build_ds_config(make_cfg("optimizer=adam", check_files=False), 1)
    assert adam["optimizer"]["params"]["adam_w_mode"] is False


def test_offloaded_adam_is_deepspeeds_cpu_adam(make_cfg):
    """With "torch_adam": true DeepSpeed builds torch's AdamW even for an offloaded optimizer."""
    for offload, zero in (("cpu_optimizer", "stage1"), ("cpu_optimizer_params", "stage3"), ("nvme", "stage3")):
        for opt in ("adamw", "adam"):
            ds = build_ds_config(make_cfg(f"optimizer={opt}", f"offload={offload}", f"zero={zero}", check_files=False), 1)
            assert ds["optimizer"]["params"]["torch_adam"] is False, (opt, offload)
    assert build_ds_config(make_cfg("optimizer=adamw", check_files=False), 1)["optimizer"]["params"]["torch_adam"]


@pytest.mark.slow
def test_every_combination_parses_in_deepspeed_at_world_1_2_8():
    out = subprocess.run([sys.executable, str(HELPER), str(free_port())], capture_output=True, text=True, timeout=600,
                         env=subprocess_env(), cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    checked = [r for r in rows if "json" in r]
    rejected = [r for r in rows if "rejected" in r]
    # 4 stages x 4 offloads x 3 precisions x 2 optimizers = 96: 54 valid (x 3 world sizes), 42 rejected by rules
    assert len(checked) == 54 * 3 and len(rejected) == 42
    for r in checked:
        ds, ov = r["json"], dict(o.split("=") for o in r["overrides"])
        assert _no_auto(ds)
        assert r["train_batch_size"] == r["micro"] * r["accum"] * r["world"] == ds["train_batch_size"]
        assert r["stage"] == int(ov["zero"][-1])
        assert r["bf16"] == (ov["precision"] == "bf16") and r["fp16"] == (ov["precision"] == "fp16")
        want_opt = {"none": None, "cpu_optimizer": "cpu", "cpu_optimizer_params": "cpu", "nvme": "nvme"}[ov["offload"]]
        assert r["offload_optimizer"] == want_opt
        assert r["optimizer"] == {"adamw": "adamw", "sgd": "SGD"}[ov["optimizer"]]
        assert r["scheduler"] is None and r["clip"] == 1.0  # no JSON scheduler: ours is passed to initialize
    for r in rejected:
        assert any("needs ZeRO" in p for p in r["rejected"])
