"""Hostile checks of `objective.loss_average=tokens` (rank/step_tokens.py: a step's micro-batches are read, and GRPO's
sampled, before its first backward).

- The look-ahead must not hide progress from the stall watchdog (core/stall.py): without it every pulled micro-batch
  was a move; with it a step's micro-batches were pulled in one burst and then counted (GRPO: sampled) and trained
  without a move, so a step of grad_accum x 50 s looked like a stall after launcher.stall_warn_s (default 120 s).
- A run with grad_accum 2 stopped at a step boundary (as by SIGTERM) and resumed logs the uninterrupted run's loss and
  grad norm step for step: the look-ahead reads exactly the step's micro-batches, so the data position saved at the
  boundary is the same as without it.
- data=iterable drops a row read past data.cutoff_len, so on 2 ranks one micro-batch of the step is the empty
  placeholder (count 0): the step's loss and grad norm still equal those of its 3 rows in one micro-batch.
Also tried, and held (not kept: each 20-60 s): micro-batch layouts 4x1, 2x2, 1x4 (with and without data.packing,
LoRA without dropout) and ZeRO-3 on 2 ranks x 1 x 2 log the same 8 losses and grad norms; a ZeRO-2 2-rank grad_accum 2
checkpoint resumed on 1 rank with grad_accum 4 logs the 2-rank run's steps 5-8; nan_policy=skip; GRPO on 2 ranks with
grad_accum 2 resumed from step 2 equals the uninterrupted run; `dsrecipes audit --ledger` is OK on these runs.
"""

from __future__ import annotations

import json

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


@pytest.mark.slow
def test_an_empty_placeholder_micro_batch_on_one_rank_leaves_the_steps_token_mean_unchanged(tmp_path):
    """data=iterable, 4 rows, the first one's prompt past data.cutoff_len (dropped when read): 1 rank x 4 rows, and
    2 ranks x 1 row x grad_accum 2, where rank 0's second micro-batch is the empty placeholder. Same loss and grad
    norm (the 4 micro-batches of the step weigh the 3 real rows' tokens; a mean of micro-batch means would not)."""
    from tests.test_train_runs import metrics, train_run

    story = " ".join(f"Step {i}: add {i} apples to the basket and count them again." for i in range(1, 9))
    pairs = [("Tell me again. " + story + story, "No."), ("What is 2 + 2?", "4"), ("How do I count apples?", story),
             ("Name a colour.", "Blue, like the sky at noon.")]
    data = tmp_path / "four.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
                            + "\n" for q, a in pairs))
    common = ["dataset=sharegpt_files", f"dataset.paths=[{data}]", "dataset.val_size=0", "dataset.max_samples=null",
              "trainer.max_steps=null", "trainer.epochs=1", "trainer.eval_every=0", "trainer.export=false",
              "trainer.report_to=[]", "data.cutoff_len=192", "data=iterable", "trainer.record_samples=true"]

    def step1(name: str, *overrides: str, world_size: int) -> tuple:
        run, _ = train_run(tmp_path, name, *common, *overrides, world_size=world_size)
        (row,) = [r for r in metrics(run) if "loss" in r]
        assert row["step"] == 1 and row["samples_seen"] == 3
        return run, (row["loss"], row["grad_norm"])

    _, joint = step1("joint", "trainer.micro_batch_size=4", "trainer.grad_accum=1", world_size=1)
    run, ranks = step1("ranks", "trainer.micro_batch_size=1", "trainer.grad_accum=2", world_size=2)
    micro = [json.loads(line)["ids"] for rank in (0, 1) for line in
             (run / "ledger" / f"rank{rank}.jsonl").read_text().splitlines()[1:]]
    assert sorted(len(ids) for ids in micro) == [0, 1, 1, 1]  # one placeholder among the step's 4 micro-batches
    assert ranks == pytest.approx(joint, rel=1e-5)
