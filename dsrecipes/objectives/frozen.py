"""Frozen models that run beside the trained one (DPO's live reference, GRPO's reward model), partitioned under
ZeRO-3 as TRL's `prepare_deepspeed` and DeepSpeed-Chat prepare them: a DeepSpeed engine without optimizer in eval
mode, so each rank holds 1/world of the parameters and gathers a layer's for its forward (a collective: every rank
runs the frozen model's forwards alike).

    inference_config(ds_config)          the run's DeepSpeed config for a forward-only engine
    partitioned(ds_config)               context: transformers' from_pretrained builds under zero.Init with it
    inference_engine(model, ds_config)   the DeepSpeed engine of a frozen model (eval mode, no gradients)
    held_parameters(module)              (parameter elements held on this rank, elements of the whole model)
    say_held(what, module, rank, zero3)  on stderr: `dsrecipes: rank R: <what> holds H of its T parameters`
                                         (+ ` (ZeRO-3 partitioned)`)
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any, Dict, Iterator, Tuple

import torch

from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.modeling.model import not_partitioned


def inference_config(ds_config: Dict[str, Any]) -> Dict[str, Any]:
    """The run's DeepSpeed config for a model that only runs forward: no optimizer, scheduler or optimizer offload
    (DeepSpeed would build them for nothing, as TRL notes)."""
    out = copy.deepcopy(ds_config)
    for key in ("optimizer", "scheduler"):
        out.pop(key, None)
    out["zero_optimization"].pop("offload_optimizer", None)
    return out


@contextlib.contextmanager
def partitioned(ds_config: Dict[str, Any]) -> Iterator[None]:
    """transformers' from_pretrained inside builds the model partitioned (zero.Init with `ds_config`, a ZeRO-3 one):
    never whole on a rank. The policy's own HfDeepSpeedConfig (a local model.path) is set aside and put back."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    with not_partitioned():
        kept = HfDeepSpeedConfig(ds_config)  # transformers holds it by a weak reference: alive for the load
        try:
            yield
        finally:
            unset_hf_deepspeed_config()
            del kept


def inference_engine(model: torch.nn.Module, ds_config: Dict[str, Any]) -> Any:
    """`model` in a DeepSpeed engine without optimizer (the run's config: `inference_config`), eval mode, frozen."""
    model.requires_grad_(False)
    engine, *_ = load_deepspeed().initialize(model=model, config=inference_config(ds_config))
    engine.eval()
    engine.requires_grad_(False)
    return engine


def held_parameters(module: torch.nn.Module) -> Tuple[int, int]:
    """(parameter elements this rank holds, elements of the whole model): under ZeRO-3 a parameter's local
    partition (`ds_tensor`) plus its gathered whole when one is kept (persistent small parameters) against its full
    size (`ds_numel`); otherwise the whole parameter on both sides."""
    held = total = 0
    for p in module.parameters():
        if hasattr(p, "ds_numel"):
            held += p.ds_tensor.numel() + p.data.numel()  # (p.data is empty while the parameter is released)
            total += p.ds_numel
        else:
            held += p.numel()
            total += p.numel()
    return held, total


def say_held(what: str, module: torch.nn.Module, rank: int, zero3: bool) -> None:
    """On stderr, what this rank holds of a frozen model (tests and people read it: partitioned or whole)."""
    held, total = held_parameters(module)
    how = " (ZeRO-3 partitioned)" if zero3 else ""
    print(f"dsrecipes: rank {rank}: {what} holds {held:,} of its {total:,} parameters{how}", file=sys.stderr,
          flush=True)
