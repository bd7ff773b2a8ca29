"""objective=dpo end to end through `python -m dsrecipes` (tiny model, bundled sample pairs, data=map, one rank in
this process; module-scoped runs shared by the assertions):

  A  precomputed reference, 20 steps over 64 training pairs (an epoch is 16 steps), ledger, export
  B  live reference (a frozen copy of the start model), 6 steps: the same losses as A step for step
  C  precomputed, 12 steps, then the same command with trainer.max_steps=20: resumes and ends with A's losses
  D  live reference under zero=stage3, 2 ranks (deepspeed launcher, a subprocess) of 2 pairs each, 6 steps: each
     rank holds half of the reference's parameters (a DeepSpeed ZeRO-3 inference engine), the losses equal A's
     (precomputed) and the final evaluation B's (live, unpartitioned)
  E  objective.loss=simpo, 4 steps, its own data cache: no reference is computed, cached or loaded

A pair is one sample: the ledger holds pair ids, each once per epoch, and the steps are planned in pairs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import in_process_environ

pytestmark = pytest.mark.slow

COMMON = ["objective=dpo", "dataset=sample_pairs", "dataset.max_samples=72", "dataset.val_size=8",
          "data.cutoff_len=256", "trainer.micro_batch_size=4", "trainer.log_every=1", "scheduler=constant",
          "scheduler.warmup_steps=2", "optimizer.lr=3e-3", "trainer.eval_every=10", "trainer.save_every=10"]


def run(workspace: Path, name: str, *overrides: str) -> Path:
    from dsrecipes.cli import main

    run_dir = workspace / name
    with in_process_environ():
        code = main([*COMMON, f"data.cache_dir={workspace / 'cache'}", f"trainer.output_dir={run_dir}",
                     f"hydra.run.dir={run_dir}", *overrides])
    assert code == 0
    return run_dir


def rows(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path):
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ws = tmp_path_factory.mktemp("dpo")
    a = run(ws, "a", "trainer.max_steps=20", "trainer.record_samples=true")
    b = run(ws, "b", "trainer.max_steps=6", "objective.reference=live", "trainer.export=false")
    run(ws, "c", "trainer.max_steps=12", "trainer.export=false")
    c = run(ws, "c", "trainer.max_steps=20", "trainer.export=false")
    return a, b, c


@pytest.fixture(scope="module")
def zero3_live(runs):
    """Run D (module docstring): beside A's workspace, so the prepared pairs are a cache hit."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    ws, run_dir = runs[0].parent, runs[0].parent / "d"
    argv = [sys.executable, "-m", "dsrecipes", *COMMON, f"data.cache_dir={ws / 'cache'}", f"trainer.output_dir={run_dir}",
            f"hydra.run.dir={run_dir}", "trainer.micro_batch_size=2", "zero=stage3", "objective.reference=live",
            "trainer.max_steps=6", "trainer.export=false", "launcher=deepspeed", "launcher.num_gpus=2"]
    proc = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return run_dir, out


def test_zero3_live_reference_is_partitioned_and_gives_the_precomputed_losses(runs, zero3_live):
    import re

    a, (d, out) = runs[0], zero3_live
    held = {int(r): (int(h.replace(",", "")), int(t.replace(",", ""))) for r, h, t in re.findall(
        r"rank (\d): live DPO reference holds ([\d,]+) of its ([\d,]+) parameters \(ZeRO-3 partitioned\)", out)}
    assert sorted(held) == [0, 1], out[-3000:]
    (_, total), = set((None, t) for _, t in held.values())
    for rank_held, _ in held.values():
        assert rank_held <= 0.55 * total  # 1/2 of every parameter (+ padding of odd sizes), never the whole model
    assert sum(h for h, _ in held.values()) >= total  # the two halves cover the model
    la, ld = losses(a), losses(d)
    assert sorted(ld) == [1, 2, 3, 4, 5, 6]
    assert [ld[s] for s in range(1, 7)] == pytest.approx([la[s] for s in range(1, 7)], rel=1e-4, abs=1e-5)
    assert (d / "checkpoints" / "step_6" / "complete.json").is_file()  # the trained engine saves beside the other
    evals = {r["step"]: r["eval_loss"] for r in rows(d) if "eval_loss" in r}
    assert sorted(evals) == [0, 6] and evals[6] < 0.69  # evaluation runs the partitioned reference too: as B's
    assert evals[6] == pytest.approx([r["eval_loss"] for r in rows(runs[1]) if r.get("step") == 6 and "eval_loss" in r][0],
                                     rel=1e-4)


@pytest.fixture(scope="module")
def simpo_run(tmp_path_factory):
    ws = tmp_path_factory.mktemp("simpo")
    return run(ws, "e", "objective.loss=simpo", "objective.beta=2", "objective.simpo_gamma=1", "trainer.max_steps=4",
               "trainer.export=false"), ws / "cache"


def test_simpo_runs_without_any_reference(simpo_run):
    e, cache = simpo_run
    assert "reference_dir" not in json.loads((e / "prepare_stats.json").read_text())
    assert (cache / "prepared").is_dir() and not list(cache.rglob("reference"))  # no reference pass
    first = [r for r in rows(e) if "loss" in r][0]
    # policy log-probs differ per pair, so unlike DPO the first loss is not log 2; the margin term pushes it up
    assert math.isfinite(first["loss"]) and first["loss"] != pytest.approx(math.log(2), abs=1e-3)
    assert -20 < first["logps_chosen"] < 0  # per-token averages
    assert first["rewards_chosen"] == pytest.approx(2 * first["logps_chosen"], rel=1e-5)
    assert sorted(r["step"] for r in rows(e) if "loss" in r) == [1, 2, 3, 4]


def test_first_step_is_log2_and_rewards_are_reported(runs):
    a, _, _ = runs
    first = [r for r in rows(a) if "loss" in r][0]  # (the step-0 evaluation comes first)
    assert first["step"] == 1 and first["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference
    assert abs(first["rewards_chosen"]) < 1e-4 and abs(first["reward_margin"]) < 1e-4
    evals = [r for r in rows(a) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    for key in ("eval_rewards_chosen", "eval_rewards_rejected", "eval_reward_accuracy", "eval_reward_margin"):
        assert all(key in r for r in evals)
    train = [r for r in rows(a) if "loss" in r]
    assert sum(r["loss"] for r in train[-5:]) < sum(r["loss"] for r in train[:5])  # it learns to prefer `chosen`


def test_a_pair_is_one_sample_exactly_once_per_epoch(runs):
    from dsrecipes.config.load import load_run_config
    from dsrecipes.data.plan.ledger import verify_ledgers
    from dsrecipes.data.prepare.build import load_prepared

    a, _, _ = runs
    stats = json.loads((a / "prepare_stats.json").read_text())
    assert stats["samples"] == {"train": 64, "val": 8} and stats["row_kind"] == "pair"
    train_ids = [i for r in load_prepared(load_run_config(a), a).train["ids"] for i in r]
    report = verify_ledgers(a, expected_ids=train_ids, global_batch=4, complete_epochs=[0])
    assert report.ok, report.problems
    assert report.samples_per_rank[0] == 20 * 4
    assert Path(stats["reference_dir"]).parent.parent == Path(stats["cache_dir"])


def test_live_reference_gives_the_precomputed_losses(runs):
    a, b, _ = runs
    la, lb = losses(a), losses(b)
    assert sorted(lb) == [1, 2, 3, 4, 5, 6]
    assert [lb[s] for s in range(1, 7)] == pytest.approx([la[s] for s in range(1, 7)], rel=1e-4, abs=1e-5)
    assert not (b / "prepare_stats.json").read_text().count("reference_dir")


def test_resumed_run_ends_with_the_uninterrupted_losses(runs):
    a, _, c = runs
    la, lc = losses(a), losses(c)
    assert [lc[s] for s in range(13, 21)] == pytest.approx([la[s] for s in range(13, 21)], rel=1e-5)


def test_export_loads_as_a_plain_causal_lm(runs):
    from transformers import AutoModelForCausalLM

    a, _, _ = runs
    model = AutoModelForCausalLM.from_pretrained(a / "export")
    assert model.config.vocab_size > 0
