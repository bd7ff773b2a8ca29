"""GRPO's reward model (`objective.reward_model`) under ZeRO-3: partitioned over the ranks in a DeepSpeed inference
engine (objectives/frozen.py), as DPO's live reference, instead of a whole copy on every rank.

A real 2-rank run (`launcher=deepspeed launcher.num_gpus=2`, gloo on CPU, tiny policy) at zero=stage3 with a tiny
sequence-classification directory as the reward model, and the same command at zero=stage2 (a whole copy per rank):
each ZeRO-3 rank says it holds about half of the reward model; the ZeRO-2 ranks the whole of it; the step-1 reward
part and the step-0 evaluation's (the same weights sample the same completions at every stage) equal the ZeRO-2
run's; and the scores rank 0 logged beside its completions equal a whole copy's on the same texts. The validation
share is uneven (5 prompts: 2 micro-batches on one rank, 1 on the other), so one rank's evaluation scores a placeholder prompt while the
other scores a real one: the reward model's forwards (collectives under ZeRO-3) still line up, or the run hangs.
The same two runs at precision=bf16 (the reward model saved in fp32): both stages score in the saved fp32 (a whole
copy's scores on rank 0's texts, rel 1e-5), not ZeRO-3 alone in the run's bf16, and each rank says so.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
from tests.test_grpo import RUN, arithmetic

pytestmark = pytest.mark.slow

HELD = r"rank (\d): reward model holds ([\d,]+) of its ([\d,]+) parameters( \(ZeRO-3 partitioned\))?"


def reward_model(out: Path) -> Path:
    """A tiny one-label Llama scorer with the tiny tokenizer beside (as objective=reward exports one)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def two_ranks(ws: Path, name: str, stage: str, *extra: str) -> str:
    argv = [sys.executable, "-m", "dsrecipes", *RUN, f"dataset.paths=[{ws / 'p.jsonl'}]",
            f"data.cache_dir={ws / 'cache'}", f"trainer.output_dir={ws / name}", f"hydra.run.dir={ws / name}",
            f"objective.reward_model={ws / 'rm'}", "objective.reward_model_weight=0.5", f"zero={stage}",
            "trainer.max_steps=1", "trainer.grad_accum=1", "dataset.val_size=5", "trainer.eval_every=1",
            "trainer.save_every=0", "launcher=deepspeed", "launcher.num_gpus=2", *extra]
    proc = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def rows(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ws = tmp_path_factory.mktemp("rm_zero3")
    arithmetic(ws / "p.jsonl", 14)
    reward_model(ws / "rm")
    return ws, two_ranks(ws, "z3", "stage3"), two_ranks(ws, "z2", "stage2")


def held(out: str):
    return {int(r): (int(h.replace(",", "")), int(t.replace(",", "")), bool(z)) for r, h, t, z in re.findall(HELD, out)}


def test_each_zero3_rank_holds_half_of_the_reward_model(runs):
    _, z3, z2 = runs
    got = held(z3)
    assert sorted(got) == [0, 1], z3[-3000:]
    (total,) = {t for _, t, _ in got.values()}
    assert all(z and h <= 0.55 * total for h, _, z in got.values())  # 1/2 of each parameter (+ padding): never whole
    assert sum(h for h, _, _ in got.values()) >= total  # the halves cover the model
    assert held(z2) == {0: (total, total, False), 1: (total, total, False)}  # ZeRO-2: a whole copy per rank


def test_partitioned_scores_equal_the_whole_copy(runs):
    ws = runs[0]
    z3, z2 = rows(ws / "z3"), rows(ws / "z2")
    step = {name: next(r for r in got if r.get("step") == 1 and "loss" in r) for name, got in (("z3", z3), ("z2", z2))}
    assert step["z3"]["reward_reward_model"] == pytest.approx(step["z2"]["reward_reward_model"], rel=1e-5)
    assert step["z3"]["reward_reward_model"] != 0.0
    evals = {name: next(r for r in got if r.get("step") == 0 and "eval_reward_reward_model" in r)
             for name, got in (("z3", z3), ("z2", z2))}
    assert evals["z3"]["eval_reward_reward_model"] == pytest.approx(evals["z2"]["eval_reward_reward_model"], rel=1e-5)


def test_logged_scores_are_the_whole_models_on_the_same_texts(runs):
    """Independent of sampling: rank 0's logged completions, scored again by a whole copy in this process."""
    from dsrecipes.objectives.rewards import load_reward_model

    ws = runs[0]
    shown = [json.loads(line) for line in (ws / "z3" / "grpo_samples.jsonl").read_text().splitlines()]
    assert shown
    whole = load_reward_model(str(ws / "rm"), None)([s["prompt"] + s["completion"] for s in shown])
    assert [s["parts"]["reward_model"] for s in shown] == pytest.approx(whole, rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def bf16_runs(runs):
    """The same runs at precision=bf16, the reward model still saved in fp32."""
    ws = runs[0]
    return ws, two_ranks(ws, "z3_bf16", "stage3", "precision=bf16"), two_ranks(ws, "z2_bf16", "stage2", "precision=bf16")


def test_a_bf16_run_scores_with_the_reward_models_saved_fp32_at_every_stage(bf16_runs):
    """Was: under ZeRO-3 zero.Init and the engine cast the fp32-saved reward model to the run's bf16 (ZeRO-2 loads
    it as saved): its logged scores were off a whole fp32 copy's by up to ~1e-2 (rel up to 27% near 0), the step's
    reward part off ZeRO-2's. Now both stages score in float32, and say so."""
    from dsrecipes.objectives.rewards import load_reward_model

    ws, z3, z2 = bf16_runs
    for name, out in (("z3_bf16", z3), ("z2_bf16", z2)):
        shown = [json.loads(line) for line in (ws / name / "grpo_samples.jsonl").read_text().splitlines()]
        assert shown
        whole = load_reward_model(str(ws / "rm"), None)([s["prompt"] + s["completion"] for s in shown])
        assert [s["parts"]["reward_model"] for s in shown] == pytest.approx(whole, rel=1e-5, abs=1e-6), name
        lines = re.findall(HELD + r", in ([a-z]+\d+)", out)  # two ranks' lines can run together on the console
        assert len(lines) == 2 and {line[-1] for line in lines} == {"float32"}, out[-3000:]
    step = {n: next(r for r in rows(ws / n) if r.get("step") == 1 and "loss" in r) for n in ("z3_bf16", "z2_bf16")}
    assert step["z3_bf16"]["reward_reward_model"] == pytest.approx(step["z2_bf16"]["reward_reward_model"], rel=1e-5)
