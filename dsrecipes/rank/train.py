"""The training recipe, on every rank: setup -> loop -> eval -> checkpoint -> export. Read `train()` top to bottom.

Objective. What a micro-batch is, its loss and the evaluation belong to the run's objective (`objective=sft`;
dsrecipes/objectives/base.py says the contract); this loop only calls it.

Loss weighting. A micro-batch's loss is the objective's mean over that micro-batch (SFT: the mean cross-entropy over
its predicted tokens, objectives/sft.py). DeepSpeed divides each micro-batch loss by `grad_accum` and averages
gradients over ranks, so one optimizer step minimises the plain mean of its `grad_accum x world_size` micro-batch
means: every micro-batch weighs the same, whatever its number of trained tokens. (Token-exact weighting would need
the step's global token count before the first backward.) Logged `loss` is that same mean over the log window.

Stopping. Every rank holds the run directory's rank lock while it runs (rundir.rank_lock). At each step boundary the
ranks agree (step_guard.py) whether a loss was non-finite (the step is never applied: `trainer.nan_policy`) and
whether a SIGTERM/SIGINT arrived (stopping.py): then they save a checkpoint at that step and end with the signal's
exit code. Rank 0 writes how the ranks ended into rank_outcome.json for the launching process.
"""

from __future__ import annotations

import functools
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch

import dsrecipes.core.heartbeat as heartbeat
import dsrecipes.core.stopping as stopping
from dsrecipes.boundary.checkpoint_find import committed
from dsrecipes.config.defaults import learning_rate
from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.disk_space import ExportOutOfSpace
from dsrecipes.core.distributed import all_ranks, finish_distributed, init_distributed
from dsrecipes.core.errors import DataError, RunInterrupted, TrainingFailed, UserError
from dsrecipes.core.export_dir import EXPORT_BEST_DIR, EXPORT_DIR, EXPORT_INIT_DIR
from dsrecipes.core.rundir import (
    CHECKPOINTS_DIR,
    launcher_alive,
    rank_lock,
    read_ds_config,
    write_outcome,
    write_rank_steps,
)
from dsrecipes.core.runplan import RunPlan, read_plan
from dsrecipes.core.schema import LauncherKind, NanPolicy, TrainConfig
from dsrecipes.core.topology import train_batch_size
from dsrecipes.data.ledger import LedgerWriter
from dsrecipes.data.strategies import build_loaders
from dsrecipes.modeling.model import build_model, count_parameters, load_tokenizer, trainable_parameters
from dsrecipes.objectives import build_objective
from dsrecipes.objectives.base import Objective
from dsrecipes.observe.metrics import MetricsLogger
from dsrecipes.rank.checkpoint import ResumePoint, TrainState, load_checkpoint, open_resume, save_checkpoint
from dsrecipes.rank.evaluation import EvalLedger, evaluate
from dsrecipes.rank.export import export_checkpoint, export_initial
from dsrecipes.rank.gen_eval import build_prompt_eval
from dsrecipes.rank.schedule import StepScheduler, warmup_steps
from dsrecipes.rank.selection import Selector, Verdict
from dsrecipes.rank.step_guard import StepGuard, discard_step, nonfinite, pause_for_signal
from dsrecipes.rank.step_window import Window


@dataclass
class Session:
    """Everything one rank trains with, built by `start()`."""

    cfg: TrainConfig
    run_dir: Path
    plan: RunPlan
    rank: int
    engine: Any
    objective: Objective
    train_loader: Any
    eval_loader: Any
    state: TrainState
    metrics: MetricsLogger
    ledger: Any
    last_checkpoint: Optional[Path]
    selector: Any = None  # save_best / early stopping (selection.py), over state.selection
    eval_ledger: Any = None  # which samples each evaluation scored (trainer.record_samples)
    prompt_eval: Any = None  # trainer.prompt_eval_every (gen_eval.py)


# Fault injection for tests (tests/test_multinode.py): rank 0 stalls after this step, so that a node can be killed
# while the run is in flight at a known point.
STALL_AFTER_STEP_ENV = "DSRECIPES_STALL_AFTER_STEP"


def train(cfg: TrainConfig, run_dir: str | Path) -> TrainState:
    """Train `cfg` in `run_dir` (written by the launching process: config.yaml, plan.json, ds_config.json)."""
    run_dir = Path(run_dir)
    lock = rank_lock(run_dir)
    try:
        with stopping.handling():
            session = start(cfg, run_dir)
            try:
                loop(session)
            except (RunInterrupted, TrainingFailed) as exc:
                stopped(session, exc)
                raise
            except BaseException as exc:  # a crash (or Ctrl-C twice): trackers record a failed run, not a running one
                if not isinstance(exc, (UserError, KeyboardInterrupt)):
                    heartbeat.explain_crash()  # a broken collective because a peer died: name it (exits)
                heartbeat.stop()
                session.metrics.close(ok=False)
                raise
            finish(session)
    finally:
        lock.release()
    return session.state


def start(cfg: TrainConfig, run_dir: Path) -> Session:
    """Join the process group, build model, loaders and engine, and load the planned checkpoint."""
    deepspeed = load_deepspeed()

    plan = read_plan(run_dir)
    check_plan_current(plan, run_dir)
    seed_everything(cfg.trainer.seed)
    rank, world_size = init_distributed()
    if rank == 0 and plan.supervised and cfg.launcher.kind is not LauncherKind.local:  # (local: the same process)
        stopping.watch(lambda: launcher_alive(run_dir), cfg.trainer.stop_grace_s, "the launching process")
    heartbeat.start(run_dir, rank, world_size, cfg.launcher.peer_timeout_s)  # a dead node ends the run, not a hang
    if world_size != plan.world_size:
        raise DataError(f"{run_dir}/plan.json was made for {plan.world_size} ranks, but {world_size} started; "
                        "start the run again with `python -m dsrecipes` so the launcher plans it")
    tokenizer = load_tokenizer(cfg)
    ds_config = read_ds_config(run_dir)
    model = build_model(cfg, tokenizer, ds_config)
    if rank == 0 and cfg.trainer.export and cfg.model.path is None and not (run_dir / EXPORT_INIT_DIR).is_dir():
        export_initial(cfg, tokenizer, run_dir / EXPORT_INIT_DIR)  # the prompt-eval baseline of the tiny model
    train_loader, eval_loader = build_loaders(cfg, tokenizer, rank, world_size, run_dir, plan)  # data read once
    check_loader(train_loader, plan)
    resume = open_resume(plan.resume)
    schedule = functools.partial(StepScheduler, cfg=cfg.scheduler, peak_lr=learning_rate(cfg),
                                 total_steps=plan.total_steps)  # DeepSpeed calls it with the optimizer it built
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable_parameters(model), config=ds_config,
                                           lr_scheduler=schedule)
    skip_identity_allreduce(engine, world_size, cfg.zero.stage)
    objective = build_objective(cfg, tokenizer)
    objective.attach(cfg, tokenizer, engine)
    state = TrainState() if resume is None else load_checkpoint(engine, train_loader, resume)
    engine.lr_scheduler.resume_at(state.step)  # this run's schedule (its step budget) from the first resumed step
    metrics = MetricsLogger(run_dir, rank, plan.total_steps, start_step=state.step, cfg=cfg)
    metrics.info(describe_run(cfg, model, plan, resume))
    eval_ledger = EvalLedger(run_dir, rank) if cfg.trainer.record_samples and eval_loader is not None else None
    prompt_eval = build_prompt_eval(cfg, tokenizer, rank, world_size, run_dir)
    return Session(cfg, run_dir, plan, rank, engine, objective, train_loader, eval_loader, state, metrics,
                   open_ledger(cfg, run_dir, rank), None if resume is None else resume.tag_dir,
                   Selector(cfg, state.selection), eval_ledger, prompt_eval)


def skip_identity_allreduce(engine, world_size: int, zero_stage: int) -> None:
    """One rank without ZeRO: DeepSpeed's backward still "all-reduces" the gradients over a group of one (flatten
    every gradient into one buffer, scale by 1/1, all_reduce, copy back: four passes over all gradients per step, an
    identity). Measured on CPU with SmolLM2-135M (cProfile, 1 rank, 6 steps): 8.6 s in it, 1.4 s a step.
    DeepSpeed skips it itself when it has no process group (`enable_backward_allreduce = False`, the flag its
    `no_sync()` and pipeline engine rely on); with one rank the result is the same bit for bit, so it is skipped
    here too. ZeRO 1-3 reduce in their optimizers and keep their own path."""
    if world_size == 1 and zero_stage == 0:
        engine.enable_backward_allreduce = False


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
    for batch in batches:
        closes_step = engine.is_gradient_accumulation_boundary()
        loss, batch["sums"] = s.objective.loss(engine, batch, engine.device)
        loss = guard.add(loss, batch, state.step + 1)
        engine.backward(loss)
        if s.ledger is not None:
            s.ledger.record(batch["epoch"], state.step + 1, batch["ids"])
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
        pause_for_signal(state.step, s.rank, lambda: stop_requested(s))
        if state.step >= total or state.selection.get("stopped"):  # the budget, or early stopping
            break
        if s.rank == 0 and os.environ.get(STALL_AFTER_STEP_ENV) == str(state.step):
            time.sleep(3600)  # fault injection: a run in flight, the other ranks waiting in their next collective


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
    if not all_ranks(weights_finite(s.engine)):
        raise TrainingFailed(f"non-finite weights after step {s.state.step}; the run stopped without saving them",
                             s.state.step)
    lora = s.cfg.model.lora.enabled  # the frozen base is rebuilt from model.path, so it is not saved
    record = {"data_fingerprint": s.plan.data_fingerprint, "data_files": s.plan.data_files}
    s.last_checkpoint = save_checkpoint(s.engine, s.train_loader, s.state, s.run_dir,
                                        keep=s.cfg.trainer.keep_checkpoints, frozen_excluded=lora, record=record,
                                        protect=s.selector.protected())


def stop_requested(s: Session) -> bool:
    """A stop signal here, or (rank 0) the launching process is gone: a SIGKILLed launcher leaves no ranks training
    on their own; they checkpoint and stop like on SIGTERM."""
    if stopping.requested() is not None:
        return True
    return s.rank == 0 and s.plan.supervised and not launcher_alive(s.run_dir)


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


# ---------------------------------------------------------------------------------------------------------------
# Setup helpers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def weights_finite(engine: Any) -> bool:
    """This rank's trainable weights (its ZeRO-3 partition where parameters are partitioned) are all finite."""
    for param in trainable_parameters(engine.module):
        tensor = getattr(param, "ds_tensor", param)
        if not bool(torch.isfinite(tensor.detach()).all()):
            return False
    return True


def check_plan_current(plan: RunPlan, run_dir: Path) -> None:
    """Ranks started from an old plan (a SLURM job requeued with its original plan.json, launch.txt re-run by hand)
    must not train over checkpoints committed since: the launching process has to plan the resume."""

    newest = committed(run_dir / CHECKPOINTS_DIR)
    name = newest[0].name if newest else None
    if name != plan.newest_checkpoint:
        raise UserError(f"{run_dir}: checkpoint {name} was committed after this run was planned (plan.json knows "
                        f"{plan.newest_checkpoint}); start it through `python -m dsrecipes` with "
                        f"trainer.output_dir={run_dir}, which plans the resume")


def check_loader(loader: Any, plan: RunPlan) -> None:
    """Collective: every rank's loader must give the planned steps per epoch (ranks with different step counts hang
    in their collectives until a timeout), so all ranks fail together when one disagrees."""
    if all_ranks(loader.steps_per_epoch == plan.steps_per_epoch):
        return
    raise DataError(f"rank loaders disagree with plan.json ({plan.steps_per_epoch} steps per epoch; this rank: "
                    f"{loader.steps_per_epoch}): the data changed since the launching process planned the run; "
                    "start it again with `python -m dsrecipes`")


def open_ledger(cfg: TrainConfig, run_dir: Path, rank: int) -> Optional[Any]:
    if not cfg.trainer.record_samples:
        return None

    return LedgerWriter(run_dir, rank)


def describe_run(cfg: TrainConfig, model: Any, plan: RunPlan, resume: Optional[ResumePoint]) -> str:
    trainable, total = count_parameters(model)
    world = plan.world_size
    lines = [
        (f"model {cfg.model.name}: {total:,} parameters ({trainable:,} trainable), {cfg.precision.dtype.value}, "
         f"ZeRO-{cfg.zero.stage}, {world} rank(s)"),
        (f"{plan.total_steps} optimizer steps of {train_batch_size(cfg, world)} rows "
         f"({cfg.trainer.micro_batch_size} x {cfg.trainer.grad_accum} accum x {world} ranks)"),
    ]
    if resume is not None:
        how = f", written by {resume.saved_world_size} ranks" if resume.saved_world_size != world else ""
        lines.append(f"resumed from {resume.tag_dir}{how}" + (" (universal checkpoint)" if resume.universal else ""))
    _, note = warmup_steps(cfg.scheduler, plan.total_steps)
    if note is not None:
        lines.append(note)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Loop helpers


def micro_batches(loader: Any, state: TrainState) -> Iterator[Dict[str, Any]]:
    """Micro-batches across epochs, keeping `state.epoch` current. `set_epoch` of the epoch a resumed loader stands
    in keeps its position. Endless for a step budget: the caller stops at the last step (the same on every rank)."""
    while True:
        loader.set_epoch(state.epoch)
        for batch in loader:
            state.epoch = batch["epoch"]  # an endless stream moves to its next epoch by itself
            yield batch
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
    )
    window.reset()
