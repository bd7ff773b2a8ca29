"""build_ds_config(): the only producer of DeepSpeed JSON.

Every value is derived from the typed config and the real data-parallel world size; nothing is stored, nothing is
"auto" (DeepSpeed does not understand it), and no key is emitted that DeepSpeed would silently ignore.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from dsrecipes.config.defaults import learning_rate
from dsrecipes.config.schema import OffloadDevice, OptimizerKind, Precision, SchedulerKind, TrainConfig


def train_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Samples (or packed rows) per optimizer step over the whole data-parallel world."""
    return cfg.trainer.micro_batch_size * cfg.trainer.grad_accum * world_size


def build_ds_config(
    cfg: TrainConfig, world_size: int, total_steps: Optional[int] = None, *, load_universal: bool = False
) -> Dict[str, Any]:
    """DeepSpeed config dict for `cfg` at `world_size` data-parallel ranks.

    `total_steps` (optimizer steps of the whole run) feeds the decaying schedulers; it defaults to
    `trainer.max_steps`. For epoch-based runs the launcher computes it from the data plan. `load_universal`: the
    run resumes a ZeRO-1/2/3 checkpoint saved at another world size (elastic resume via a universal checkpoint).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    t = cfg.trainer
    total = total_steps if total_steps is not None else t.max_steps
    ds: Dict[str, Any] = {
        "train_batch_size": train_batch_size(cfg, world_size),
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.gradient_clipping,
        "steps_per_print": t.log_every,
        "wall_clock_breakdown": False,
        "seed": t.seed,
        "optimizer": _optimizer(cfg),
        "scheduler": SCHEDULERS[cfg.scheduler.name](cfg, total),
        "zero_optimization": _zero(cfg),
    }
    ds.update(_precision(cfg))
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    if cfg.optimizer.name in (OptimizerKind.sgd, OptimizerKind.lion) and cfg.zero.stage > 0:
        # DeepSpeed asks for an explicit opt-in for optimizers outside its ZeRO-tested list.
        ds["zero_allow_untested_optimizer"] = True
    return ds


def _optimizer(cfg: TrainConfig) -> Dict[str, Any]:
    o = cfg.optimizer
    lr = learning_rate(cfg)  # optimizer.lr, or the model's own when it is null
    betas = list(o.betas)
    if o.name is OptimizerKind.adamw:
        params = {"lr": lr, "betas": betas, "eps": o.eps, "weight_decay": o.weight_decay, "torch_adam": o.torch_adam}
        return {"type": "AdamW", "params": params}
    if o.name is OptimizerKind.adam:
        params = {"lr": lr, "betas": betas, "eps": o.eps, "weight_decay": o.weight_decay,
                  "torch_adam": o.torch_adam, "adam_w_mode": False}
        return {"type": "Adam", "params": params}
    if o.name is OptimizerKind.lion:
        return {"type": "Lion", "params": {"lr": lr, "betas": betas, "weight_decay": o.weight_decay}}
    if o.name is OptimizerKind.sgd:
        # Not a DeepSpeed optimizer name: DeepSpeed falls back to torch.optim.SGD.
        return {"type": "SGD", "params": {"lr": lr, "momentum": o.momentum, "weight_decay": o.weight_decay}}
    raise AssertionError(o.name)


def _needs_total(cfg: TrainConfig, total: Optional[int]) -> int:
    if total is None:
        raise ValueError(
            f"scheduler={cfg.scheduler.name.value} decays over the run, so it needs the total number of optimizer "
            "steps: set trainer.max_steps, or let the launcher compute it from the data plan"
        )
    return max(total, _warmup(cfg)[0] + 1)


def _warmup(cfg: TrainConfig) -> Tuple[int, float]:
    """(warmup_num_steps, starting fraction of the peak lr). DeepSpeed's schedulers reject 0 warmup steps, so
    "no warmup" is one step that already starts at the peak."""
    steps = cfg.scheduler.warmup_steps
    return (steps, 0.0) if steps > 0 else (1, 1.0)


def _constant(cfg: TrainConfig, total: Optional[int]) -> Dict[str, Any]:
    steps, start = _warmup(cfg)
    lr = learning_rate(cfg)
    return {"type": "WarmupLR", "params": {"warmup_min_lr": lr * start, "warmup_max_lr": lr,
                                          "warmup_num_steps": steps, "warmup_type": "linear"}}


def _linear(cfg: TrainConfig, total: Optional[int]) -> Dict[str, Any]:
    steps, start = _warmup(cfg)
    lr = learning_rate(cfg)
    return {"type": "WarmupDecayLR", "params": {"total_num_steps": _needs_total(cfg, total), "warmup_min_lr": lr * start,
                                               "warmup_max_lr": lr, "warmup_num_steps": steps,
                                               "warmup_type": "linear"}}


def _cosine(cfg: TrainConfig, total: Optional[int]) -> Dict[str, Any]:
    steps, start = _warmup(cfg)
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": _needs_total(cfg, total), "warmup_min_ratio": start,
                                                "warmup_num_steps": steps, "cos_min_ratio": cfg.scheduler.min_lr_ratio,
                                                "warmup_type": "linear"}}


SCHEDULERS: Dict[SchedulerKind, Callable[[TrainConfig, Optional[int]], Dict[str, Any]]] = {
    SchedulerKind.constant: _constant,
    SchedulerKind.linear: _linear,
    SchedulerKind.cosine: _cosine,
}


def _offload(device: OffloadDevice, cfg: TrainConfig) -> Dict[str, Any]:
    out: Dict[str, Any] = {"device": device.value, "pin_memory": cfg.offload.pin_memory}
    if device is OffloadDevice.nvme:
        out["nvme_path"] = cfg.offload.nvme_path
    return out


def _zero(cfg: TrainConfig) -> Dict[str, Any]:
    z = cfg.zero
    out: Dict[str, Any] = {"stage": z.stage}
    if z.stage == 0:
        return out
    out.update({"overlap_comm": z.overlap_comm, "contiguous_gradients": z.contiguous_gradients,
                "reduce_bucket_size": z.reduce_bucket_size})
    if z.stage in (1, 2):
        out["allgather_bucket_size"] = z.allgather_bucket_size
    if z.stage == 3:
        out.update({
            "stage3_prefetch_bucket_size": z.stage3_prefetch_bucket_size,
            "stage3_param_persistence_threshold": z.stage3_param_persistence_threshold,
            "stage3_max_live_parameters": z.stage3_max_live_parameters,
            "stage3_gather_16bit_weights_on_model_save": z.stage3_gather_16bit_weights_on_model_save,
        })
    if cfg.offload.optimizer is not OffloadDevice.none:
        out["offload_optimizer"] = _offload(cfg.offload.optimizer, cfg)
    if cfg.offload.param is not OffloadDevice.none:
        out["offload_param"] = _offload(cfg.offload.param, cfg)
    return out


def _precision(cfg: TrainConfig) -> Dict[str, Any]:
    p = cfg.precision
    if p.dtype is Precision.bf16:
        return {"bf16": {"enabled": True}}
    if p.dtype is Precision.fp16:
        return {"fp16": {"enabled": True, "loss_scale": p.loss_scale, "initial_scale_power": p.initial_scale_power,
                         "loss_scale_window": p.loss_scale_window, "hysteresis": 2, "min_loss_scale": 1}}
    return {}
