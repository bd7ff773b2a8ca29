"""The training recipe, on every rank: setup -> loop -> eval -> checkpoint -> export. Read `train()` top to bottom.

Loss weighting. A micro-batch's loss is the mean cross-entropy over its predicted tokens (labels != -100, packing
boundaries excluded; `model.token_loss_sum`). DeepSpeed divides each micro-batch loss by `grad_accum` and averages
gradients over ranks, so one optimizer step minimises the plain mean of its `grad_accum x world_size` micro-batch
means: every micro-batch weighs the same, whatever its number of trained tokens. (Token-exact weighting would need
the step's global token count before the first backward.) Logged `loss` is that same mean over the log window.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch

from dsrecipes.checkpoint import (
    EXPORT_DIR,
    EXPORT_INIT_DIR,
    ResumePoint,
    TrainState,
    export_checkpoint,
    export_initial,
    load_checkpoint,
    plan_resume,
    save_checkpoint,
)
from dsrecipes.config.schema import TrainConfig
from dsrecipes.errors import UserError
from dsrecipes.metrics import MetricsLogger, Window
from dsrecipes.model import (
    build_model,
    count_parameters,
    load_tokenizer,
    micro_batch_loss,
    trainable_parameters,
)


def train(cfg: TrainConfig, run_dir: str | Path) -> TrainState:
    """Train `cfg` in `run_dir` (which holds config.yaml and ds_config.json); returns the final progress."""
    import deepspeed

    from dsrecipes.data.strategies import build_eval_loader, build_train_loader

    run_dir = Path(run_dir)
    t = cfg.trainer
    seed_everything(t.seed)
    rank, world_size = init_distributed()

    tokenizer = load_tokenizer(cfg)
    ds_config = read_ds_config(run_dir)
    model = build_model(cfg, tokenizer, ds_config)
    if rank == 0 and t.export and cfg.model.path is None and not (run_dir / EXPORT_INIT_DIR).is_dir():
        export_initial(cfg, tokenizer, run_dir / EXPORT_INIT_DIR)  # the prompt-eval baseline of the tiny model

    train_loader = build_train_loader(cfg, tokenizer, rank, world_size, run_dir)
    eval_loader = build_eval_loader(cfg, tokenizer, rank, world_size, run_dir)
    total_steps = plan_total_steps(cfg, train_loader)

    resume = plan_resume(t.resume, run_dir, world_size, cfg.zero.stage)
    if resume is not None and resume.universal != ds_config.get("checkpoint", {}).get("load_universal", False):
        raise UserError(f"{run_dir / 'ds_config.json'}: written for another resume point; start the run again "
                        "with `python -m dsrecipes` so the launcher plans the (elastic) resume")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable_parameters(model), config=ds_config)

    state, last_checkpoint = TrainState(), None
    if resume is not None:
        state, last_checkpoint = load_checkpoint(engine, train_loader, resume), resume.tag_dir

    metrics = MetricsLogger(run_dir, rank, total_steps, start_step=state.step)
    metrics.info(describe_run(cfg, model, world_size, total_steps, resume, ds_config))
    ledger = open_ledger(cfg, run_dir, rank)
    window = Window()
    window.reset()
    clock_start = time.perf_counter() - state.elapsed

    engine.train()
    batches = micro_batches(train_loader, state) if state.step < total_steps else ()
    for batch in batches:
        closes_step = engine.is_gradient_accumulation_boundary()
        loss, _ = micro_batch_loss(engine, batch, engine.device)
        engine.backward(loss)
        if closes_step and logs_at(state.step + 1, total_steps, t):
            lr, grad_norm = engine.get_lr()[0], untracked_grad_norm(engine)  # the values this step applies
        engine.step()
        window.add(loss, batch)
        if ledger is not None:
            ledger.record(batch["epoch"], state.step + 1, batch["ids"])
        if not closes_step:
            continue

        state.step += 1
        metrics.step()
        final = state.step >= total_steps
        if logs_at(state.step, total_steps, t):
            state.elapsed = time.perf_counter() - clock_start
            tracked = engine.get_global_grad_norm()
            log_window(metrics, window, state, lr, grad_norm if tracked is None else tracked)
        with window.paused():  # tokens/s counts training time only
            if eval_loader is not None and (final or due(state.step, t.eval_every)):
                metrics.log_eval(state.step, evaluate(engine, eval_loader, t.eval_batches))
            if final or due(state.step, t.save_every):
                last_checkpoint = save_checkpoint(engine, train_loader, state, run_dir, keep=t.keep_checkpoints)
        if final:
            break

    if ledger is not None:
        ledger.close()
    metrics.close()
    finish_distributed()
    if rank == 0 and t.export:  # from the final checkpoint, after the other ranks are released
        out = export_checkpoint(run_dir, last_checkpoint, run_dir / EXPORT_DIR, cfg)
        metrics.info(f"exported Hugging Face model: {out}")
    return state


# ---------------------------------------------------------------------------------------------------------------
# Setup helpers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def init_distributed() -> tuple[int, int]:
    """Join the process group the launcher described in the environment (a lone process becomes rank 0 of 1)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from dsrecipes.launch import free_port

    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ and "PMI_RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU host split its cores, leaving one for the launcher, data and OS: oversubscribed
        # intra-op threads spin-wait (the default tiny run took 117 s with 2 threads on a busy 2-core host, 29 s with 1).
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        torch.set_num_threads(max(1, ((os.cpu_count() or 1) - 1) // local_size))
    if os.environ.get("WORLD_SIZE") == "1":
        _skip_shm_comm_op()
    deepspeed.init_distributed()
    return dist.get_rank(), dist.get_world_size()


def _skip_shm_comm_op() -> None:
    """A lone process talks to nobody, so it does not need DeepSpeed's shared-memory all-reduce op, which on a CPU
    host is JIT-compiled (~45 s) the first time a process group starts. DeepSpeed treats a missing op as "use
    torch.distributed", the same path it takes where the op cannot be built."""
    import importlib

    try:  # (`import deepspeed.comm.torch as m` would bind the torch package that deepspeed.comm re-exports)
        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # another DeepSpeed layout: keep its default
        return
    if hasattr(ds_comm_torch, "build_shm_op"):
        ds_comm_torch.build_shm_op = lambda: None


def finish_distributed() -> None:
    """Wait for every rank. The process group is left up on purpose: DeepSpeed caches its groups per process and
    cannot rebuild them after destroy_process_group, so the next in-process run (local launcher, Hydra multirun)
    reuses this one. Launched ranks exit right after."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def read_ds_config(run_dir: Path) -> Dict[str, Any]:
    """The DeepSpeed dict the launching process wrote for the real world size (ranks never rebuild it)."""
    path = run_dir / "ds_config.json"
    if not path.is_file():
        raise UserError(f"{path}: missing; start runs with `python -m dsrecipes` (it writes the run directory)")
    return json.loads(path.read_text(encoding="utf-8"))


def plan_total_steps(cfg: TrainConfig, loader: Any) -> int:
    """Optimizer steps of the run; checks every rank got the same number of steps per epoch (else ranks hang)."""
    from dsrecipes.errors import DataError

    spe = loader.steps_per_epoch
    if spe is not None:
        lo, hi = _min_max_over_ranks(spe)
        if lo != hi:
            raise DataError(f"ranks disagree on steps per epoch ({lo} vs {hi}); the data plan must equalise them")
        if spe < 1:
            raise DataError("the training split yields no full optimizer step per epoch; lower the batch size")
    if cfg.trainer.max_steps is not None:
        return cfg.trainer.max_steps
    if spe is None:
        raise DataError("trainer.max_steps: the training stream has no known length; set a step budget")
    return cfg.trainer.epochs * spe


def _min_max_over_ranks(value: int) -> tuple[int, int]:
    import torch.distributed as dist

    both = torch.tensor([-value, value], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return -int(both[0]), int(both[1])


def open_ledger(cfg: TrainConfig, run_dir: Path, rank: int) -> Optional[Any]:
    if not cfg.trainer.record_samples:
        return None
    from dsrecipes.data.ledger import LedgerWriter

    return LedgerWriter(run_dir, rank)


def describe_run(cfg: TrainConfig, model: Any, world_size: int, total_steps: int, resume: Optional[ResumePoint],
                 ds_config: Dict[str, Any]) -> str:
    trainable, total = count_parameters(model)
    lines = [
        (f"model {cfg.model.name}: {total:,} parameters ({trainable:,} trainable), {cfg.precision.dtype.value}, "
         f"ZeRO-{cfg.zero.stage}, {world_size} rank(s)"),
        (f"{total_steps} optimizer steps of {ds_config['train_batch_size']} rows "
         f"({cfg.trainer.micro_batch_size} x {cfg.trainer.grad_accum} accum x {world_size} ranks)"),
    ]
    if resume is not None:
        how = f", written by {resume.saved_world_size} ranks" if resume.saved_world_size != world_size else ""
        lines.append(f"resumed from {resume.tag_dir}{how}" + (" (universal checkpoint)" if resume.universal else ""))
    planned = ds_config.get("scheduler", {}).get("params", {}).get("total_num_steps")
    if planned is not None and planned < total_steps:
        lines.append(f"warning: the LR schedule in ds_config.json ends at step {planned}, before step {total_steps}")
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


def log_window(metrics: MetricsLogger, window: Window, state: TrainState, lr: float, grad_norm: Any) -> None:
    """Reduce the log window over ranks (collective) and write one metrics line on rank 0."""
    totals = window.reduce()
    state.samples_seen += int(totals["samples"])
    metrics.log_train(
        step=state.step,
        loss=totals["loss"],
        lr=float(lr),
        grad_norm=None if grad_norm is None else float(grad_norm),
        tokens_per_s=totals["tokens"] / totals["seconds"],
        samples_seen=state.samples_seen,
        elapsed=state.elapsed,
    )
    window.reset()


@torch.no_grad()
def evaluate(engine: Any, loader: Any, max_batches: Optional[int]) -> float:
    """Token-weighted mean validation loss over all ranks. Ranks stop together at the shortest split (ZeRO-3
    forwards are collective), after at most `max_batches` micro-batches each."""
    import torch.distributed as dist

    engine.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    batches = iter(loader)
    done = 0
    while max_batches is None or done < max_batches:
        batch = next(batches, None)
        if not _all_ranks(batch is not None):
            break
        loss, n_tokens = micro_batch_loss(engine, batch, engine.device)
        sums += torch.tensor([float(loss) * int(n_tokens), int(n_tokens)], dtype=torch.float64)
        done += 1
    dist.all_reduce(sums)
    engine.train()
    return float(sums[0] / sums[1].clamp(min=1))


def _all_ranks(flag: bool) -> bool:
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
