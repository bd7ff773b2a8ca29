"""GRPO's reward model keeps the dtype it was saved in under ZeRO-3 as under ZeRO-0/1/2 (objectives/frozen.py): in a
bf16 run's ZeRO-3 config, one rank (gloo, in a subprocess: the process group stays there), a tiny reward model saved
in fp32 or in bf16 scores exactly as a whole copy loaded as saved does, with every parameter partitioned or with the
small ones kept whole (stage3_param_persistence_threshold), and says the dtype it scores in. Was: an fp32-saved one
scored in bf16 under ZeRO-3 only (zero.Init casts to its config's precision)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

pytestmark = pytest.mark.slow

SCRIPT = """
import json, sys, torch, deepspeed
deepspeed.init_distributed(dist_backend="gloo")
from dsrecipes.objectives.rewards import load_reward_model
path, threshold = sys.argv[1], int(sys.argv[2])
cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}
texts = ["1+2=3", "4+4=9 and some more text", "hello"]
print(json.dumps({"whole": load_reward_model(path, None)(texts), "zero3": load_reward_model(path, None, cfg)(texts)}))
"""


@pytest.mark.parametrize("threshold", [0, 100_000])
@pytest.mark.parametrize("saved", ["float32", "bfloat16"])
def test_zero3_scores_in_the_saved_dtype(tmp_path: Path, saved: str, threshold: int):
    import torch

    from dsrecipes.core.distributed import free_port
    from tests.test_reward_model_zero3 import reward_model

    rm = reward_model(tmp_path / "rm")
    if saved == "bfloat16":
        from transformers import AutoModelForSequenceClassification

        AutoModelForSequenceClassification.from_pretrained(rm).to(torch.bfloat16).save_pretrained(rm)
    env = subprocess_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": str(free_port())})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(rm), str(threshold)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["zero3"] == pytest.approx(got["whole"], rel=1e-6, abs=1e-7), got
    assert f"parameters, in {saved}" in proc.stderr and f"(ZeRO-3 partitioned), in {saved}" in proc.stderr, \
        proc.stderr[-3000:]
