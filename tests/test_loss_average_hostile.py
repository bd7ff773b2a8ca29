"""Hostile checks of `objective.loss_average=tokens` (rank/step_tokens.py: a step's micro-batches are read, and GRPO's
sampled, before its first backward).

- The look-ahead must not hide progress from the stall watchdog (core/stall.py): without it every pulled micro-batch
  was a move; with it a step's micro-batches were pulled in one burst and then counted (GRPO: sampled) and trained
  without a move, so a step of grad_accum x 50 s looked like a stall after launcher.stall_warn_s (default 120 s).
- A run with grad_accum 2 stopped at a step boundary (as by SIGTERM) and resumed logs the uninterrupted run's loss and
  grad norm step for step: the look-ahead reads exactly the step's micro-batches, so the data position saved at the
  boundary is the same as without it.
"""

from __future__ import annotations

import pytest

from dsrecipes.rank.step_tokens import weigh_steps


def test_each_counted_and_trained_micro_batch_of_a_weighed_step_is_progress_for_the_stall_watchdog():
    """One step of 4 micro-batches, each taking 50 s to sample (`count`) and 50 s to train, on a fake clock the
    watchdog (stall_warn_s=120) sees after every 50 s: it never warns. Before, 400 s passed without a move."""
    from dsrecipes.core import stall

    stall.reset()
    clock = [0.0]
    watch = stall.Watch(warn_s=120, timeout_s=1800)
    verdicts = []

    def work() -> None:  # 50 s of sampling or forward/backward, then the watchdog looks
        clock[0] += 50.0
        verdicts.append(watch.observe({0: stall.current.encode()}, clock[0]))

    def count(batch) -> int:
        work()
        return 3

    watch.observe({0: stall.current.encode()}, clock[0])
    for _ in weigh_steps([{"n": i} for i in range(4)], grad_accum=4, world_size=1, count=count):
        work()
    assert len(verdicts) == 8 and verdicts == [None] * 8, verdicts
    stall.reset()


@pytest.mark.slow
def test_a_grad_accum_2_run_stopped_at_a_step_boundary_resumes_with_the_same_losses_and_grad_norms(tmp_path):
    """In this process (launcher=local): 8 steps of 2 micro-batches; the same run asked to stop at step 3's boundary
    (checkpoint, exit 143), then the same command again: every step's loss and grad norm equal the first run's."""
    import dsrecipes.rank.train as train
    from tests.test_train_runs import metrics, train_run

    common = ["trainer.grad_accum=2", "trainer.micro_batch_size=2"]

    def logged(run):
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics(run) if "loss" in r}

    reference, _ = train_run(tmp_path, "reference", *common, world_size=1)
    asked = train.stop_requested
    train.stop_requested = lambda s: s.state.step + 1 == 3 or asked(s)
    try:
        stopped, _ = train_run(tmp_path, "stopped", *common, world_size=1, expect_ok=False)
    finally:
        train.stop_requested = asked
    assert sorted(logged(stopped)) == [1, 2, 3]
    train_run(tmp_path, "stopped", *common, world_size=1)
    assert logged(stopped) == logged(reference) and sorted(logged(reference)) == list(range(1, 9))
