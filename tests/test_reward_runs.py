"""objective=reward in real runs (CPU, tiny model).

- Run A, 2 ranks (`python -m dsrecipes ... launcher=deepspeed`, gloo): 6 steps of 2 pairs per rank, a checkpoint
  every 2 steps, evaluation at steps 0, 3 and 6. Its ledger (`trainer.record_samples=true`) passes `dsrecipes audit
  --ledger`: no pair twice in the epoch across ranks, the same steps on both ranks; every evaluation reports the
  held-out pairwise accuracy and mean margin.
- Exact resume (one rank, in this process: `launcher=local`): run U uninterrupted; run K, the same command, gets
  SIGTERM after step 3 (after step 2's checkpoint): it checkpoints at the next step boundary and exits; the same
  command again resumes and ends with U's per-step losses, U's pair ids per step and U's evaluations, bit for bit.
- Elastic resume: A's step-2 checkpoint continued on one rank (`trainer.resume_from`, grad_accum doubled: the same
  global batch) trains exactly A's pairs at every step 3-6 (a step's global batch is world-size free under data=map)
  to A's losses within rounding (one rank sums what two all-reduced).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.test_train_runs import metrics, train_run

pytestmark = pytest.mark.slow

REWARD = ["objective=reward", "dataset=sample_pairs", "dataset.max_samples=36", "dataset.val_size=8",
          "data.cutoff_len=256", "trainer.micro_batch_size=2", "trainer.max_steps=6", "trainer.save_every=2",
          "trainer.keep_checkpoints=3", "trainer.eval_every=3", "trainer.record_samples=true",
          "trainer.export=false", "scheduler=constant"]
ONE_RANK = ["trainer.grad_accum=2"]  # 2 x 2 pairs: A's global batch on one rank


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}  # a replayed step: its last record


def evals(run_dir: Path) -> dict:
    return {r["step"]: (r["eval_loss"], r["eval_reward_accuracy"], r["eval_reward_margin"])
            for r in metrics(run_dir) if "eval_reward_accuracy" in r}


def ledger(run_dir: Path) -> dict:
    """{(epoch, step): sorted pair ids of every rank}: what the run finally trained on at each step."""
    from dsrecipes.data.plan.ledger import LEDGER_DIR, read_ledger

    steps: dict = {}
    for path in (run_dir / LEDGER_DIR).glob("rank*.jsonl"):
        for key, ids in read_ledger(path).items():
            steps.setdefault(key, []).extend(ids)
    return {k: sorted(v) for k, v in steps.items()}


@contextmanager
def sigterm_after_step(step: int):
    """SIGTERM to this process right after optimizer step `step` (as a scheduler's preemption would send it)."""
    from dsrecipes.rank import train

    original = train.after_step
    assert list(inspect.signature(original).parameters) == ["s"], "the fault point moved"

    def after_step(s):
        original(s)
        if s.state.step == step:
            os.kill(os.getpid(), signal.SIGTERM)

    train.after_step = after_step
    try:
        yield
    finally:
        train.after_step = original


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reward_runs")


@pytest.fixture(scope="module")
def run_a(workspace) -> Path:
    run, _ = train_run(workspace, "a", *REWARD)
    return run


def test_two_rank_reward_run_reads_every_pair_once_with_equal_steps_and_evaluates(run_a):
    from dsrecipes.commands.audit import main as audit_main
    from dsrecipes.data.plan.ledger import verify_ledgers

    result = json.loads((run_a / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == 6
    report = verify_ledgers(run_a, global_batch=4)
    assert report.ok, report.summary()
    assert report.steps_per_rank == {0: 6, 1: 6} and report.samples_per_rank == {0: 12, 1: 12}
    assert audit_main(["--ledger", str(run_a)]) == 0
    got = evals(run_a)
    assert sorted(got) == [0, 3, 6]
    assert all(0 <= acc <= 1 and math.isfinite(margin) for _, acc, margin in got.values())
    train = [r for r in metrics(run_a) if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 7)) and all("reward_accuracy" in r for r in train)


def test_sigterm_after_a_checkpoint_then_the_same_command_resumes_exactly(workspace):
    uninterrupted, _ = train_run(workspace, "u", *REWARD, *ONE_RANK, world_size=1)
    with sigterm_after_step(3):
        killed, _ = train_run(workspace, "k", *REWARD, *ONE_RANK, world_size=1, expect_ok=False)
    stopped = max(losses(killed))  # at the step boundary after the signal
    assert sorted(losses(killed)) == list(range(1, stopped + 1)) and stopped in (3, 4)
    assert sorted(p.name for p in (killed / "checkpoints").glob("step_*")) == ["step_2", f"step_{stopped}"]
    train_run(workspace, "k", *REWARD, *ONE_RANK, world_size=1)  # the same command: resumes from there
    assert json.loads((killed / "result.json").read_text())["status"] == "ok"
    assert losses(killed) == losses(uninterrupted)
    assert ledger(killed) == ledger(uninterrupted) and len(ledger(killed)) == 6
    assert evals(killed) == evals(uninterrupted)


def test_reward_run_resumes_elastically_on_one_rank(run_a, workspace):
    run, _ = train_run(workspace, "e", *REWARD, *ONE_RANK, f"trainer.resume_from={run_a / 'checkpoints' / 'step_2'}",
                       world_size=1)
    got, want = losses(run), losses(run_a)
    assert sorted(got) == [3, 4, 5, 6]
    assert all(math.isclose(got[s], want[s], rel_tol=1e-5) for s in got), (got, want)
    a, e = ledger(run_a), ledger(run)
    assert [e[(0, s)] for s in range(3, 7)] == [a[(0, s)] for s in range(3, 7)]
