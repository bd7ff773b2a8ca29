"""build_ds_config(): the only producer of DeepSpeed JSON.

Every value is derived from the typed config and the real data-parallel world size; nothing is stored, nothing is
"auto" (DeepSpeed does not understand it), and no key is emitted that DeepSpeed would silently ignore. There is no
"scheduler" section: DeepSpeed's schedulers train the first step at lr 0, so the LR schedule is our own object
(schedule.py), handed to `deepspeed.initialize(lr_scheduler=...)` by the training recipe.
"""

from __future__ import annotations

from typing import Any, Dict

from dsrecipes.config.defaults import learning_rate
from dsrecipes.core.schema import OffloadDevice, OptimizerKind, Precision, TrainConfig
from dsrecipes.core.topology import train_batch_size


def build_ds_config(cfg: TrainConfig, world_size: int, *, load_universal: bool = False) -> Dict[str, Any]:
    """DeepSpeed config dict for `cfg` at `world_size` data-parallel ranks.

    `load_universal`: the run resumes a ZeRO-1/2/3 checkpoint saved at another world size (elastic resume via a
    universal checkpoint).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    t = cfg.trainer
    ds: Dict[str, Any] = {
        "train_batch_size": train_batch_size(cfg, world_size),
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.gradient_clipping,
        "steps_per_print": t.log_every,
        "wall_clock_breakdown": False,
        "seed": t.seed,
        "optimizer": _optimizer(cfg),
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
    # DeepSpeed honours torch_adam before it looks at offload: an offloaded Adam would be torch's, stepping on the
    # CPU at a fraction of DeepSpeedCPUAdam's speed (the reason to offload at all). Offloaded: DeepSpeed's CPU Adam.
    torch_adam = o.torch_adam and cfg.offload.optimizer is OffloadDevice.none
    if o.name is OptimizerKind.adamw:
        params = {"lr": lr, "betas": betas, "eps": o.eps, "weight_decay": o.weight_decay, "torch_adam": torch_adam}
        return {"type": "AdamW", "params": params}
    if o.name is OptimizerKind.adam:
        params = {"lr": lr, "betas": betas, "eps": o.eps, "weight_decay": o.weight_decay,
                  "torch_adam": torch_adam, "adam_w_mode": False}
        return {"type": "Adam", "params": params}
    if o.name is OptimizerKind.lion:
        return {"type": "Lion", "params": {"lr": lr, "betas": betas, "weight_decay": o.weight_decay}}
    if o.name is OptimizerKind.sgd:
        # Not a DeepSpeed optimizer name: DeepSpeed falls back to torch.optim.SGD.
        return {"type": "SGD", "params": {"lr": lr, "momentum": o.momentum, "weight_decay": o.weight_decay}}
    raise AssertionError(o.name)


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
