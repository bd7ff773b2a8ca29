"""The training recipe, on every rank: setup -> loop -> eval -> checkpoint -> export. Read `train()` top to bottom.
The setup (process group, model, loaders, engine, resume: the `Session`) is session.py's `start()`; this module runs
the session and ends it.

Objective. What a micro-batch is, its loss and the evaluation belong to the run's objective (`objective=sft`;
dsrecipes/objectives/base.py says the contract); this loop only calls it.

Loss weighting. With `objective.loss_average=tokens` (SFT's default) each trained token of an optimizer step weighs
the same across its `grad_accum` micro-batches and the ranks (step_tokens.py: the step's token count is summed over
the ranks before its first backward); the logged `loss` is then the mean over the log window's steps of each step's
token mean. GRPO likewise over completion tokens (its step's completions are sampled before the step's first backward). With
`micro_batches` (and for the preference objectives, whose loss is a mean per pair) a micro-batch's
loss is its own mean; DeepSpeed divides it by `grad_accum` and averages gradients over ranks, so every micro-batch
weighs the same whatever its number of trained tokens, and `loss` is the mean of the micro-batch means.

Stopping. Every rank holds the run directory's rank lock while it runs (rundir.rank_lock). At each step boundary the
ranks agree (step_guard.py) whether a loss was non-finite (the step is never applied: `trainer.nan_policy`) and
whether a SIGTERM/SIGINT arrived (stopping.py): then they save a checkpoint at that step and end with the signal's
exit code. Rank 0 writes how the ranks ended into rank_outcome.json for the launching process.
"""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import torch

import dsrecipes.core.heartbeat as heartbeat
import dsrecipes.core.stall as stall
import dsrecipes.core.stopping as stopping
from dsrecipes.core.disk_space import ExportOutOfSpace
from dsrecipes.core.distributed import all_ranks, finish_distributed
from dsrecipes.core.errors import RunInterrupted, TrainingFailed, UserError
from dsrecipes.core.export_dir import EXPORT_BEST_DIR, EXPORT_DIR
from dsrecipes.core.rank_records import write_outcome, write_rank_steps
from dsrecipes.core.rundir import CHECKPOINTS_DIR, launcher_alive, rank_lock
from dsrecipes.core.schema import NanPolicy, TrainConfig
from dsrecipes.data.strategies.base import worker_died
from dsrecipes.modeling.model import trainable_parameters
from dsrecipes.rank.checkpoint import TrainState, save_checkpoint
from dsrecipes.rank.evaluation import evaluate
from dsrecipes.rank.export import export_checkpoint
from dsrecipes.rank.selection import Verdict
from dsrecipes.rank.session import Session, start
from dsrecipes.rank.step_guard import StepGuard, discard_step, nonfinite
from dsrecipes.rank.step_tokens import weigh_steps
from dsrecipes.rank.step_window import Window


def train(cfg: TrainConfig, run_dir: str | Path) -> TrainState:
    """Train `cfg` in `run_dir` (written by the launching process: config.yaml, plan.json, ds_config.json)."""
    run_dir = Path(run_dir)
    lock = rank_lock(run_dir)
    try:
        with stopping.handling():
            try:
                session = start(cfg, run_dir)
            except BaseException:
                heartbeat.stop_alone()
                raise
            collector_on()
            try:
                loop(session)
            except (RunInterrupted, TrainingFailed) as exc:
                stopped(session, exc)
                raise
            except BaseException as exc:  # a crash (or Ctrl-C twice): trackers record a failed run, not a running one
                if not isinstance(exc, (UserError, KeyboardInterrupt)) and not worker_died(exc):
                    heartbeat.explain_crash()  # a broken collective because a peer died: name it (exits)
                heartbeat.stop()
                session.metrics.close(ok=False)
                raise
            finish(session)
    finally:
        lock.release()
    return session.state


def collector_on() -> None:
    """In a rank process, which starts with the cyclic collector off (rank/worker.py): what start-up left alive is
    frozen out of every later collection, and the collector runs from here on. Elsewhere (a run inside the launching
    process: launcher=local) the collector was never turned off, and nothing changes."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def loop(s: Session) -> None:
    """Micro-batches until the planned last step: forward/backward/step, then per step log, evaluate, save."""
    t, engine, state, total = s.cfg.trainer, s.engine, s.state, s.plan.total_steps
    guard = StepGuard(s.plan.world_size, engine.device, s.rank)
    if state.step == 0 and s.last_checkpoint is None and t.eval_at_start:
        evaluate_and_log(s, True, True)  # the starting point (step 0), before the clock starts
    window = Window(keys=s.objective.train_keys)
    window.reset()
    clock_start = time.perf_counter() - state.elapsed
    engine.train()
    ended = state.step >= total or state.selection.get("stopped")  # (a resumed run that stopped early: ends)
    batches = micro_batches(s.train_loader, state) if not ended else ()
    if s.objective.step_tokens:  # objective.loss_average=tokens: each token of a step weighs the same
        batches = weigh_steps(batches, engine.gradient_accumulation_steps(), s.plan.world_size,
                              lambda batch: s.objective.tokens(engine, batch, engine.device))
    for batch in batches:
        closes_step = engine.is_gradient_accumulation_boundary()
        loss, batch["sums"] = s.objective.loss(engine, batch, engine.device)
        loss = guard.add(loss, batch, state.step + 1)
        engine.backward(loss)
        if s.ledger is not None:
            s.ledger.record(batch["epoch"], state.step + 1, batch["ids"], batch.get("keys"))
        if not closes_step:
            engine.step()  # between boundaries DeepSpeed only counts the micro-step (the next boundary needs it)
            continue
        bad, stop = guard.agree(stop_requested(s))  # collective: every rank decides alike
        if bad:
            skip = t.nan_policy is NanPolicy.skip
            state.skipped_steps += int(skip)
            nonfinite(skip, guard, state.step + 1, t.nan_max_skips)
            guard.take_pending()
            discard_step(engine, state.step + 1)
            s.metrics.info(f"step {state.step + 1}: non-finite loss, step skipped ({state.skipped_steps} so far)")
        else:
            guard.skipped_in_a_row = 0
            if logs_at(state.step + 1, total, t) or stop:
                lr, grad_norm = engine.get_lr()[0], untracked_grad_norm(engine)  # the values this step applies
            engine.step()
            for micro_loss, micro_batch in guard.take_pending():
                window.add(micro_loss, micro_batch)
        state.step += 1
        if bad:  # a skipped step counts in the schedule too (DeepSpeed's overflow path does not step it)
            engine.lr_scheduler.resume_at(state.step)
        s.metrics.step()
        if (logs_at(state.step, total, t) or stop) and not bad:
            state.elapsed = time.perf_counter() - clock_start
            tracked = engine.get_global_grad_norm()
            log_window(s, window, lr, grad_norm if tracked is None else tracked)
        with window.paused():  # tokens/s counts training time only
            after_step(s)
        if stop and state.step < total:  # at the last step the run simply ends (and exports)
            stop_here(s)
        if state.step >= total or state.selection.get("stopped"):  # the budget, or early stopping
            break


def after_step(s: Session) -> None:
    """Evaluation and checkpoint at their intervals, and both at the last step."""
    t, step = s.cfg.trainer, s.state.step
    final = step >= s.plan.total_steps
    verdict = evaluate_and_log(s, final or due(step, t.eval_every), final or due(step, t.prompt_eval_every))
    if final or due(step, t.save_every) or verdict.improved or verdict.stop:  # the best and the last are kept
        save(s)
    if verdict.stop:
        s.metrics.info(f"step {step}: {verdict.stop}")


def evaluate_and_log(s: Session, loss: bool, prompts: bool) -> Verdict:
    """Collective: evaluate the current weights (validation loss, prompt-eval: those due and configured), log the
    numbers (rank 0) and judge them (save_best, early stopping: the same verdict on every rank, from the same
    reduced numbers)."""
    step, numbers = s.state.step, {}
    stall.mark("eval", step)  # where this rank is, for the stall watchdog (core/stall.py): no I/O
    if loss and s.eval_loader is not None:
        numbers.update(evaluate(s.objective, s.engine, s.eval_loader, s.eval_ledger, step))  # the same on every rank
    if prompts and s.prompt_eval is not None:
        numbers.update(s.prompt_eval.run(s.engine))
    if not numbers:
        return Verdict(False, None)
    s.metrics.log_eval(step, numbers)
    if not math.isfinite(numbers.get("eval_loss", 0.0)):
        raise TrainingFailed(f"non-finite evaluation loss after step {step}: the weights no longer give finite "
                             "outputs, so the run stopped without saving them. Lower optimizer.lr or check the "
                             "data", step)
    return s.selector.observe(step, numbers)


def save(s: Session) -> None:
    """Collective checkpoint, after checking that every rank's weights are finite (never save non-finite ones)."""
    stall.mark("checkpoint", s.state.step)
    if not all_ranks(weights_finite(s.engine)):
        raise TrainingFailed(f"non-finite weights after step {s.state.step}; the run stopped without saving them",
                             s.state.step)
    lora = s.cfg.model.lora.enabled  # the frozen base is rebuilt from model.path, so it is not saved
    record = {"data_fingerprint": s.plan.data_fingerprint, "data_files": s.plan.data_files,
              "total_steps": s.plan.total_steps, "stopped_early": s.state.selection.get("stopped")}  # check_budget
    s.last_checkpoint = save_checkpoint(s.engine, s.train_loader, s.state, s.run_dir,
                                        keep=s.cfg.trainer.keep_checkpoints, frozen_excluded=lora, record=record,
                                        protect=s.selector.protected())


LAUNCHER_CHECK_S = 1.0  # rank 0 asks whether the launcher still holds the run directory at most this often


def stop_requested(s: Session) -> bool:
    """A stop signal here, or (rank 0) the launching process is gone: a SIGKILLed launcher leaves no ranks training
    on their own; they checkpoint and stop like on SIGTERM. The launcher's lock is tried at most once a second (a
    flock and two syscalls per step otherwise: 0.1-0.3% of a small model's step)."""
    if stopping.requested() is not None:
        return True
    if s.rank != 0 or not s.plan.supervised:
        return False
    now = time.monotonic()
    if now - s.launcher_seen_at < LAUNCHER_CHECK_S:
        return False
    if not launcher_alive(s.run_dir):
        return True
    s.launcher_seen_at = now
    return False


def stop_here(s: Session) -> None:
    """Every rank, at the boundary where they agreed to stop: checkpoint this step (unless after_step just did)."""
    if s.last_checkpoint is None or s.last_checkpoint.name != f"step_{s.state.step}":
        save(s)
    raise RunInterrupted(stopping.requested() or 15, s.state.step)


def stopped(s: Session, exc: Exception) -> None:
    """Rank 0 records how the run ended; the sinks are closed (metrics.jsonl, plot, ledger; trackers marked failed)
    on every rank. The heartbeat stops first: ranks that end at slightly different times are not taken for dead."""
    heartbeat.stop()
    for ledger in (s.ledger, s.eval_ledger):
        if ledger is not None:
            ledger.close()
    s.metrics.close(ok=False)
    if s.rank != 0:
        return
    if isinstance(exc, RunInterrupted):
        write_outcome(s.run_dir, {"status": "interrupted", "signal": exc.exit_code - 128, "stopped_at_step": exc.step,
                                  "skipped_steps": s.state.skipped_steps})
    else:
        write_outcome(s.run_dir, {"status": "failed", "error": str(exc), "failed_step": getattr(exc, "step", None),
                                  "skipped_steps": s.state.skipped_steps})


def finish(s: Session) -> None:
    """Close the sinks, release the other ranks, then export from the final checkpoint (and the best one) on rank 0."""
    for ledger in (s.ledger, s.eval_ledger):
        if ledger is not None:
            ledger.close()
    s.metrics.close()
    heartbeat.stop()  # before the last barrier: ranks that finish first are not taken for dead
    write_rank_steps(s.run_dir, s.rank, s.state.step, s.plan.total_steps,  # before it: all exist once one is past
                     ended_early=s.state.selection.get("stopped"))  # early stopping: fewer steps, still a success
    finish_distributed()
    if s.rank == 0 and s.cfg.trainer.export:
        try:
            out = export_checkpoint(s.run_dir, s.last_checkpoint, s.run_dir / EXPORT_DIR, s.cfg)
        except ExportOutOfSpace as exc:  # the checkpoints are intact: result.json says failed, with why
            write_outcome(s.run_dir, {"status": "failed", "error": str(exc), "skipped_steps": s.state.skipped_steps})
            raise TrainingFailed(str(exc), s.state.step) from None
        s.metrics.info(f"exported Hugging Face model: {out}")
        for best in s.selector.protected():
            if not (s.run_dir / CHECKPOINTS_DIR / best).is_dir():  # pruned before a resume from an older checkpoint
                s.metrics.info(f"the best checkpoint {best} is no longer in {CHECKPOINTS_DIR}/; not exported")
                continue
            out = export_checkpoint(s.run_dir, s.run_dir / CHECKPOINTS_DIR / best, s.run_dir / EXPORT_BEST_DIR,
                                    s.cfg, key=EXPORT_BEST_DIR)
            s.metrics.info(f"exported the best checkpoint ({best}): {out}")
    if s.rank == 0:
        write_outcome(s.run_dir, {"status": "ok", "skipped_steps": s.state.skipped_steps, **s.selector.outcome()})


def weights_finite(engine: Any) -> bool:
    """This rank's trainable weights (its ZeRO-3 partition where parameters are partitioned) are all finite."""
    for param in trainable_parameters(engine.module):
        tensor = getattr(param, "ds_tensor", param)
        if not bool(torch.isfinite(tensor.detach()).all()):
            return False
    return True


# ---------------------------------------------------------------------------------------------------------------
# Loop helpers


def micro_batches(loader: Any, state: TrainState) -> Iterator[Dict[str, Any]]:
    """Micro-batches across epochs, keeping `state.epoch` current. `set_epoch` of the epoch a resumed loader stands
    in keeps its position. Endless for a step budget: the caller stops at the last step (the same on every rank)."""
    while True:
        stall.mark("data", state.step)  # waiting for the next batch (the stall watchdog, core/stall.py)
        loader.set_epoch(state.epoch)
        for batch in loader:
            stall.mark("compute", state.step)
            state.epoch = batch["epoch"]  # an endless stream moves to its next epoch by itself
            yield batch
            stall.mark("data", state.step)
        state.epoch += 1


def due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def logs_at(step: int, total_steps: int, t: Any) -> bool:
    """A metrics line closes every log window, at each checkpoint (so a resume starts a fresh window) and at the end."""
    return step >= total_steps or due(step, t.log_every) or due(step, t.save_every)


def untracked_grad_norm(engine: Any) -> Optional[float]:
    """The global gradient norm where DeepSpeed does not record one (plain fp32 data parallelism: its optimizer is
    the bare torch one). Gradients are already all-reduced after the boundary backward, so every rank agrees."""
    if hasattr(engine.optimizer, "_global_grad_norm"):
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.stack([g.detach().float().norm() for g in grads]).norm()) if grads else None


def log_window(s: Session, window: Window, lr: float, grad_norm: Any) -> None:
    """Reduce the log window over ranks (collective) and write one metrics line on rank 0."""
    metrics, state = s.metrics, s.state
    totals = window.reduce()
    if totals["micro_batches"] == 0:  # every step of the window was skipped (non-finite): nothing to report
        window.reset()
        return
    state.samples_seen += int(totals["samples"])
    metrics.log_train(
        step=state.step,
        loss=totals["loss"],
        lr=float(lr),
        grad_norm=None if grad_norm is None else float(grad_norm),
        tokens_per_s=totals["tokens"] / totals["seconds"],
        samples_seen=state.samples_seen,
        elapsed=state.elapsed,
        extra=s.objective.metrics(totals["sums"], "") if totals["sums"] else None,
        tokens=int(totals["tokens"]),
    )
    window.reset()
