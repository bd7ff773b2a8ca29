"""GRPO learns on a real model: SmolLM2-135M-Instruct (as the suite fetches it) on single-digit sums built here
(system "You are a calculator. Reply with the number only.", user "What is 3+4?", reference "7"), rewarded by the
built-in `number_equal` check only, LoRA, completions of at most 8 tokens. Judged on the HELD-OUT prompts of the
split: the evaluation samples the same completion seeds before and after training (seeds of epoch -1), so the two
held-out rewards are a paired comparison. One short run (CI time: 3 steps of 4 prompts x 4 completions, 8 held-out
prompts; each prompt is read once for its 4 completions; evaluation without the KL term samples and scores only)."""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import in_process_environ, remove_when_passed

pytestmark = pytest.mark.slow

SYSTEM = "You are a calculator. Reply with the number only."


def sums(path):
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(pairs)
    path.write_text("".join(json.dumps({"conversations": [{"from": "system", "value": SYSTEM},
                                                          {"from": "human", "value": f"What is {a}+{b}?"}],
                                        "reference": str(a + b)}) + "\n" for a, b in pairs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def grpo_run(smollm2_dir, tmp_path_factory, request):
    from dsrecipes.cli import main

    run_dir = tmp_path_factory.mktemp("smol_grpo") / "run"
    remove_when_passed(request, run_dir.parent)
    data = sums(run_dir.parent / "sums.jsonl")
    with in_process_environ():
        code = main(["objective=grpo", f"model.path={smollm2_dir}", f"dataset.paths=[{data}]", "dataset.val_size=8",
                     "objective.rewards=[{name: number_equal}]", "objective.num_generations=4",
                     "objective.max_completion_length=8", "data.cutoff_len=96", "trainer.micro_batch_size=4",
                     "trainer.max_steps=3", "trainer.eval_every=3", "model.lora.enabled=true", "optimizer.lr=5e-3",
                     "scheduler=constant", "scheduler.warmup_steps=0", "trainer.log_every=1", "trainer.save_every=0",
                     "trainer.export=false", f"data.cache_dir={run_dir.parent / 'cache'}",
                     f"trainer.output_dir={run_dir}", f"hydra.run.dir={run_dir}"])
    assert code == 0
    return run_dir


def test_held_out_exact_answers_rise(grpo_run):
    rows = [json.loads(line) for line in (grpo_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 3]
    before, after = evals[0]["eval_reward"], evals[-1]["eval_reward"]
    print(f"held-out number_equal reward: {before:.3f} -> {after:.3f}")  # shown with -s
    assert after >= before + 0.25, (before, after)
    assert (grpo_run / "grpo_samples.jsonl").is_file()
