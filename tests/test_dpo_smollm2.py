"""DPO learns on a real model: SmolLM2-135M-Instruct (as the suite fetches it) through the shipped recipe
`smollm2_cpu_dpo`, on pairs from the bundled data (a numeric answer as `chosen`, the same answer with a wrong number
as `rejected`; the single-turn rows of `dataset=sample_pairs`, for CI time), judged on the HELD-OUT pairs of the
split: the implicit reward accuracy of the final evaluation is well above chance, and the exported model prefers the
chosen answers more than the base model does, measured with plain transformers (no dsrecipes code in the
measurement). One short run shared by the assertions (CI time)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import in_process_environ, remove_when_passed

pytestmark = pytest.mark.slow


def short_pairs(root):
    """The bundled pairs as `dataset=sample_pairs` reads them (its dataset_info.json entry), keeping the single-turn
    rows without tools ("What is 29 + 30?" / "29 + 30 = 59." vs "... = 69."), unchanged: ~40 tokens per sequence
    instead of ~120 with the tool-call conversations, a third of the CPU for the same number of pairs and steps."""
    from dsrecipes.core.paths import ASSETS_DIR

    assets = ASSETS_DIR / "sample_data"
    entry = json.loads((assets / "dataset_info.json").read_text(encoding="utf-8"))["sample_pairs"]
    lines = (assets / entry["file_name"]).read_text(encoding="utf-8").splitlines()
    kept = [line for line, row in zip(lines, map(json.loads, lines))
            if len(row["conversations"]) == 1 and not row.get("tools")]
    assert len(kept) > 400
    (root / entry["file_name"]).write_text("\n".join(kept) + "\n", encoding="utf-8")
    (root / "dataset_info.json").write_text(json.dumps({"sample_pairs": entry}), encoding="utf-8")
    return root / "dataset_info.json"


@pytest.fixture(scope="module")
def dpo_run(smollm2_dir, tmp_path_factory, request):
    from dsrecipes.cli import main

    run_dir = tmp_path_factory.mktemp("smol_dpo") / "run"
    remove_when_passed(request, run_dir.parent)  # checkpoint and export: 2.2 GB
    registry = short_pairs(run_dir.parent)
    with in_process_environ():
        # 16 training pairs, 3 steps of 4 at twice the recipe's rate: held-out accuracy 14/16 (0.875) on this machine,
        # 14 of 16 margins gained (the asserts need 12); 6 steps of 48 samples at 5e-5 cost ~40 more CPU seconds.
        code = main(["recipe=smollm2_cpu_dpo", f"model.path={smollm2_dir}", f"dataset.registry={registry}",
                     "dataset.max_samples=32", "dataset.val_size=16", "trainer.max_steps=3", "optimizer.lr=1e-4",
                     "trainer.eval_every=0", "trainer.save_every=0", "trainer.eval_at_start=false",
                     f"data.cache_dir={run_dir.parent / 'cache'}", f"trainer.output_dir={run_dir}",
                     f"hydra.run.dir={run_dir}"])
    assert code == 0
    return run_dir


def test_held_out_reward_accuracy_rises_above_chance(dpo_run):
    rows = [json.loads(line) for line in (dpo_run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in rows if "eval_loss" in r][-1]
    assert final["eval_reward_accuracy"] >= 0.75, final
    assert final["eval_reward_margin"] > 0 and final["eval_loss"] < 0.69, final


@torch.no_grad()
def answer_logps(model, pairs):
    """Summed log-probability of each (prompt, answer) pair's answer tokens, with plain transformers: the sequences
    right-padded into one batch (a causal model's logits at real positions never see the padding after them)."""
    seqs = [list(prompt) + list(answer) for prompt, answer in pairs]
    lengths = torch.tensor([len(seq) for seq in seqs])
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(seq) for seq in seqs], batch_first=True)
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    logps = model(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    return [float(logps[i, len(p) - 1:len(p) + len(a) - 1].gather(1, torch.tensor(a)[:, None]).sum())
            for i, (p, a) in enumerate(pairs)]


def test_exported_model_prefers_the_chosen_answers_more_than_the_base(dpo_run, smollm2_dir):
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    stats = json.loads((dpo_run / "prepare_stats.json").read_text())
    val = load_from_disk(os.path.join(stats["cache_dir"], "val"))
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tuned = AutoModelForCausalLM.from_pretrained(dpo_run / "export", dtype=torch.float32).eval()

    def margins(model):
        chosen = answer_logps(model, [(r["prompt_ids"], r["chosen_ids"]) for r in val])
        rejected = answer_logps(model, [(r["prompt_ids"], r["rejected_ids"]) for r in val])
        return [c - r for c, r in zip(chosen, rejected)]

    before, after = margins(base), margins(tuned)
    gained = sum(a > b for a, b in zip(after, before))
    assert sum(after) / len(after) > sum(before) / len(before)
    assert gained >= 0.75 * len(val), (before, after)
