"""Live DPO references (`objective.reference=live`), built on each rank once the trained engine exists:

  LoRA      the trained model with its adapters disabled: the base it started from, no second copy
  ZeRO-3    a frozen copy in its own DeepSpeed engine for inference (the run's config without optimizer, scheduler
            and optimizer offload; eval mode), as TRL's `prepare_deepspeed` and DeepSpeed-Chat prepare a reference:
            each rank holds 1/world of its parameters and gathers a layer's for its forward; a local `model.path`
            loads partitioned (transformers' zero.Init), never whole on a rank. Every rank runs every micro-batch
            (training and evaluation), so the gathers line up as they do for the trained ZeRO-3 model.
  otherwise a frozen full copy on the rank's device (ZeRO-0/1/2 keep the trained model's weights whole too)

The engine's config and the held/total line are objectives/frozen.py's (shared with GRPO's reward model).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch

from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.schema import TrainConfig
from dsrecipes.modeling.model import build_model
from dsrecipes.objectives.base import Batch
from dsrecipes.objectives.frozen import inference_config, say_held
from dsrecipes.objectives.logps import reference_config, sequence_logps

Reference = Callable[[Batch, torch.device], Tuple[torch.Tensor, torch.Tensor]]


class LiveReference:
    """A frozen reference model (a module, or a DeepSpeed inference engine around one) beside the trained one."""

    def __init__(self, model: Any):
        model.eval()  # (a DeepSpeed engine's eval() returns None)
        model.requires_grad_(False)
        self.model = model

    @torch.no_grad()
    def __call__(self, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        logps, _ = sequence_logps(self.model, batch, device)
        return logps.chunk(2)


class AdapterReference:
    """The trained LoRA model (a DeepSpeed engine around a peft model) with its adapters disabled."""

    def __init__(self, engine: Any):
        self.engine = engine

    @torch.no_grad()
    def __call__(self, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        with self.engine.module.disable_adapter():
            logps, _ = sequence_logps(self.engine, batch, device)
        return logps.chunk(2)


def live_reference(cfg: TrainConfig, tokenizer: Any, engine: Any) -> Reference:
    """The live reference of the run (see the module docstring); a frozen copy says on stderr what this rank holds
    of it: `dsrecipes: rank R: live DPO reference holds H of its T parameters (ZeRO-3 partitioned)`."""
    if cfg.model.lora.enabled:
        return AdapterReference(engine)
    if cfg.zero.stage == 3:
        reference = LiveReference(zero3_reference(cfg, tokenizer, engine.config))
    else:
        reference = LiveReference(build_model(reference_config(cfg), tokenizer).to(engine.device))
    say_held("live DPO reference", reference.model, engine.global_rank, cfg.zero.stage == 3)
    return reference


def zero3_reference(cfg: TrainConfig, tokenizer: Any, ds_config: Dict[str, Any]) -> Any:
    """The reference model partitioned over the ranks: a DeepSpeed ZeRO-3 engine without optimizer, in eval mode."""
    config = inference_config(ds_config)
    model = build_model(reference_config(cfg), tokenizer, config)  # local model.path: loaded partitioned
    ref, *_ = load_deepspeed().initialize(model=model, config=config)
    return ref
