"""A rank's session: join the process group, build tokenizer, model, loaders, engine and objective, load the planned
checkpoint, and open the sinks (metrics, ledgers). `start()` returns the `Session` that train.py's loop runs and
ends; nothing here trains a step.

Every rank builds the same things in the same order, so the collectives here (joining, `check_loader`, loading a
checkpoint) pair up; a plan older than the newest checkpoint, or made for another world size, stops the run before
the model is built.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

import dsrecipes.core.heartbeat as heartbeat
import dsrecipes.core.rendezvous as rendezvous
import dsrecipes.core.stopping as stopping
from dsrecipes.boundary.checkpoint_find import committed
from dsrecipes.config.defaults import learning_rate
from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.distributed import all_ranks, init_distributed
from dsrecipes.core.errors import DataError, UserError
from dsrecipes.core.export_dir import EXPORT_INIT_DIR
from dsrecipes.core.rundir import CHECKPOINTS_DIR, launcher_alive, read_ds_config
from dsrecipes.core.runplan import RunPlan, read_plan
from dsrecipes.core.schema import LauncherKind, TrainConfig
from dsrecipes.core.topology import train_batch_size
from dsrecipes.data.plan.ledger import LedgerWriter
from dsrecipes.data.strategies import build_loaders
from dsrecipes.data.strategies.base import end_workers
from dsrecipes.modeling.model import build_model, count_parameters, load_tokenizer, trainable_parameters
from dsrecipes.objectives import build_objective
from dsrecipes.objectives.base import Objective
from dsrecipes.observe.metrics import MetricsLogger
from dsrecipes.rank.checkpoint import ResumePoint, TrainState, load_checkpoint, open_resume
from dsrecipes.rank.evaluation import EvalLedger
from dsrecipes.rank.export import export_initial
from dsrecipes.rank.gen_eval import build_prompt_eval
from dsrecipes.rank.schedule import StepScheduler, warmup_steps
from dsrecipes.rank.selection import Selector


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
    launcher_seen_at: float = float("-inf")  # when rank 0 last found the launcher alive (train.stop_requested)


def start(cfg: TrainConfig, run_dir: Path) -> Session:
    """Join the process group, build model, loaders and engine, and load the planned checkpoint."""
    deepspeed = load_deepspeed()

    plan = read_plan(run_dir)
    check_plan_current(plan, run_dir)
    seed_everything(cfg.trainer.seed)
    rank, world_size = init_distributed(lambda: meet_and_beat(cfg, run_dir))  # bounded
    if rank == 0 and plan.supervised and cfg.launcher.kind is not LauncherKind.local:  # (local: the same process)
        stopping.watch(lambda: launcher_alive(run_dir), cfg.trainer.stop_grace_s, "the launching process")
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
    resume = open_resume(plan.resume, run_dir)
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
    eval_ledger = (EvalLedger(run_dir, rank, world_size)  # its world: audit drops a retired rank's evaluations
                   if cfg.trainer.record_samples and eval_loader is not None else None)
    prompt_eval = build_prompt_eval(cfg, tokenizer, rank, world_size, run_dir)
    return Session(cfg, run_dir, plan, rank, engine, objective, train_loader, eval_loader, state, metrics,
                   open_ledger(cfg, run_dir, rank, world_size), None if resume is None else resume.tag_dir,
                   Selector(cfg, state.selection, plan.past_stop), eval_ledger, prompt_eval)


def skip_identity_allreduce(engine, world_size: int, zero_stage: int) -> None:
    """One rank without ZeRO: DeepSpeed's backward still "all-reduces" the gradients over a group of one (flatten
    every gradient into one buffer, scale by 1/1, all_reduce, copy back: four passes over all gradients per step, an
    identity). Measured on CPU with SmolLM2-135M (cProfile, 1 rank, 6 steps): 8.6 s in it, 1.4 s a step.
    DeepSpeed skips it itself when it has no process group (`enable_backward_allreduce = False`, the flag its
    `no_sync()` and pipeline engine rely on); with one rank the result is the same bit for bit, so it is skipped
    here too. ZeRO 1-3 reduce in their optimizers and keep their own path."""
    if world_size == 1 and zero_stage == 0:
        engine.enable_backward_allreduce = False


# ---------------------------------------------------------------------------------------------------------------
# Setup helpers


def meet_and_beat(cfg: TrainConfig, run_dir: Path) -> None:
    """Right before joining the process group (core/distributed.init_distributed, which set RANK and WORLD_SIZE):
    every rank meets the others within launcher.rendezvous_timeout_s (core/rendezvous.py), then starts its heartbeat,
    so a rank that dies or stops while the process group starts is named after launcher.peer_timeout_s instead of
    holding the others in init_process_group for the process-group timeout (30 minutes). From here on a dead node
    ends the run, not a hang, nor does a stuck rank (core/stall.py)."""
    rendezvous.meet(cfg.launcher.rendezvous_timeout_s)
    ln = cfg.launcher
    heartbeat.start(run_dir, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), ln.peer_timeout_s,
                    ln.stall_warn_s, ln.stall_timeout_s, in_process=ln.kind is LauncherKind.local,
                    before_exit=end_workers)  # fmt: skip


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


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


def open_ledger(cfg: TrainConfig, run_dir: Path, rank: int, world_size: int) -> Optional[Any]:
    if not cfg.trainer.record_samples:
        return None
    return LedgerWriter(run_dir, rank, world_size)  # the session mark names its world: audit checks an elastic resume


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
