"""The pipeline on the real test model: SmolLM2-135M-Instruct, SFT -> a reward model -> DPO (both from the SFT
export), as one `dsrecipes pipeline` command (LoRA merged into the SFT export, short cutoff, a few steps: CI's budget;
the reward model's and DPO's exports are left out: nothing in the test reads them, and merging and writing each costs
seconds; SFT evaluates 8 of its 16 held-out rows; DPO's reference is live, the LoRA adapters disabled: no second load of the SFT
export and no pass over all pairs before training: the same losses and accuracies).

The pairs are the short single-turn ones test_dpo_smollm2 uses (`short_pairs`, shared), split once into a `reward`
and a `dpo` share by row hash (dataset.split); each stage reads its share only. What it proves: the stages chain (the
reward and DPO runs start from the SFT export), SFT lowers held-out loss from the base model's, the reward model's
pairwise accuracy on its held-out pairs rises from its random head's to well above chance, DPO's implicit reward
accuracy on its held-out pairs is well above chance, and the summary compares the stages."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.conftest import in_process_environ, remove_when_passed
from tests.test_dpo_smollm2 import short_pairs

pytestmark = pytest.mark.slow

PIPELINE = """\
shared:
  model.lora.enabled: true
  data.cutoff_len: 128
  trainer: {{save_every: 0, log_every: 1, eval_every: 0, micro_batch_size: 4, eval_samples: 16}}
  scheduler.warmup_steps: 0
  model.path: {base}
stages:
  - name: sft
    recipe: smollm2_cpu_sft
    set:
      dataset: {{max_samples: 48, val_size: 16}}
      trainer: {{max_steps: 2, eval_samples: 8}}
      optimizer.lr: 1.0e-3
  - name: reward
    model_from: sft
    recipe: smollm2_cpu_dpo
    set:
      objective: reward
      dataset.registry: {registry}
      dataset.split.shares: {{reward: 1, dpo: 1}}
      dataset.split.take: reward
      dataset: {{max_samples: 36, val_size: 16}}
      trainer: {{max_steps: 5, export: false}}
      optimizer.lr: 3.0e-3
  - name: dpo
    model_from: sft
    recipe: smollm2_cpu_dpo
    set:
      dataset.registry: {registry}
      dataset.split.shares: {{reward: 1, dpo: 1}}
      dataset.split.take: dpo
      objective.reference: live
      dataset: {{max_samples: 32, val_size: 16}}
      trainer: {{max_steps: 3, eval_at_start: false, export: false}}
      optimizer.lr: 1.0e-3
"""


@pytest.fixture(scope="module")
def pipeline_run(smollm2_dir, tmp_path_factory, request):
    from dsrecipes.cli import main

    root = tmp_path_factory.mktemp("smol_pipeline")
    remove_when_passed(request, root)  # two merged exports: 1 GB
    registry = short_pairs(root)
    path = root / "pipeline.yaml"
    path.write_text(PIPELINE.format(base=smollm2_dir, registry=registry), encoding="utf-8")
    started = time.perf_counter()
    with in_process_environ():
        code = main(["pipeline", str(path), "--out", str(root / "out")])
    print(f"SmolLM2 pipeline: {time.perf_counter() - started:.1f} s")
    assert code == 0
    return root / "out"


def evals(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval_loss" in r]


def test_sft_then_reward_model_and_dpo_from_its_export(pipeline_run, smollm2_dir):
    sft, reward, dpo = pipeline_run / "sft", pipeline_run / "reward", pipeline_run / "dpo"
    start, end = evals(sft)
    assert end["eval_loss"] < start["eval_loss"] < 2.5, (start, end)  # from the pretrained level, lowered
    for stage in (reward, dpo):
        assert yaml.safe_load((stage / "config.yaml").read_text())["model"]["path"] == str(sft / "export")
    first, last = evals(reward)
    assert last["eval_reward_accuracy"] >= 0.75 > first["eval_reward_accuracy"], (first, last)  # 0.875 measured
    final = evals(dpo)[-1]
    assert final["eval_reward_accuracy"] >= 0.75 and final["eval_reward_margin"] > 0, final
    state = json.loads((pipeline_run / "pipeline_state.json").read_text())["stages"]
    assert [state[s]["status"] for s in ("sft", "reward", "dpo")] == ["done"] * 3
    summary = (pipeline_run / "pipeline_summary.md").read_text()
    assert "| sft | sft | 2 |" in summary and "| reward | reward | 5 |" in summary and "| dpo | dpo | 3 |" in summary
    assert (pipeline_run / "pipeline_summary.png").stat().st_size > 10_000
