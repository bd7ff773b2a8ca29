"""Frozen models that run beside the trained one (DPO's live reference, GRPO's reward model), partitioned under
ZeRO-3 as TRL's `prepare_deepspeed` and DeepSpeed-Chat prepare them: a DeepSpeed engine without optimizer in eval
mode, so each rank holds 1/world of the parameters and gathers a layer's for its forward (a collective: every rank
runs the frozen model's forwards alike).

A model loaded with `partitioned` (GRPO's reward model) keeps the dtype it was saved in, as the whole copy of
ZeRO-0/1/2 does (transformers' dtype="auto"), not the run's: zero.Init casts every parameter it builds to the
precision of its DeepSpeed config (the run's bf16 section: an fp32-saved reward model would score in bf16 under
ZeRO-3 only), so it builds from the run's config without a precision section (fp32: any saved dtype loads exactly),
and `inference_engine` casts the partitions to the saved dtype (`model.config.dtype`) in an engine whose config has
no precision section either (DeepSpeed casts no ZeRO-Init parameter; DeepSpeed-Chat likewise gives its frozen
models their own eval config and dtype).

    inference_config(ds_config)          the run's DeepSpeed config for a forward-only engine
    partitioned(ds_config)               context: transformers' from_pretrained builds under zero.Init with it (fp32)
    inference_engine(model, ds_config)   the DeepSpeed engine of a frozen model loaded so (eval mode, no gradients,
                                         its saved dtype)
    held_parameters(module)              (parameter elements held on this rank, elements of the whole model)
    say_held(what, module, rank, zero3)  on stderr: `dsrecipes: rank R: <what> holds H of its T parameters`
                                         (+ ` (ZeRO-3 partitioned)`) + `, in <dtype>` (what its forward runs in)
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any, Dict, Iterator, Tuple

import torch

from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.modeling.model import not_partitioned

PRECISION_SECTIONS = ("bf16", "bfloat16", "fp16")  # DeepSpeed's: a config with none of them is fp32


def inference_config(ds_config: Dict[str, Any]) -> Dict[str, Any]:
    """The run's DeepSpeed config for a model that only runs forward: no optimizer, scheduler or optimizer offload
    (DeepSpeed would build them for nothing, as TRL notes)."""
    out = copy.deepcopy(ds_config)
    for key in ("optimizer", "scheduler"):
        out.pop(key, None)
    out["zero_optimization"].pop("offload_optimizer", None)
    return out


def _fp32(ds_config: Dict[str, Any]) -> Dict[str, Any]:
    """`inference_config(ds_config)` without a precision section: zero.Init builds fp32 parameters with it, and an
    engine casts none (the frozen model's own dtype, module docstring)."""
    out = inference_config(ds_config)
    for key in PRECISION_SECTIONS:
        out.pop(key, None)
    return out


@contextlib.contextmanager
def partitioned(ds_config: Dict[str, Any]) -> Iterator[None]:
    """transformers' from_pretrained inside builds the model partitioned (zero.Init with `ds_config`, a ZeRO-3 one,
    less its precision: fp32, so any saved dtype loads exactly): never whole on a rank. The policy's own
    HfDeepSpeedConfig (a local model.path) is set aside and put back."""
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    with not_partitioned():
        kept = HfDeepSpeedConfig(_fp32(ds_config))  # transformers holds it by a weak reference: alive for the load
        try:
            yield
        finally:
            unset_hf_deepspeed_config()
            del kept


def inference_engine(model: torch.nn.Module, ds_config: Dict[str, Any]) -> Any:
    """`model` (loaded in `partitioned`) in a DeepSpeed engine without optimizer (the run's config less its
    optimizer and precision), eval mode, frozen, its partitions in the dtype it was saved in."""
    model.requires_grad_(False)
    saved = saved_dtype(model)
    for p in model.parameters():
        if hasattr(p, "ds_tensor") and p.ds_tensor.dtype != saved and p.ds_tensor.is_floating_point():
            p.ds_tensor.data = p.ds_tensor.data.to(saved)  # this rank's partition (what every gather reads)
            p.data = p.data.to(saved)  # empty while released; whole for a parameter kept whole
    engine, *_ = load_deepspeed().initialize(model=model, config=_fp32(ds_config))
    engine.eval()
    engine.requires_grad_(False)
    return engine


def saved_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's directory was saved in, as transformers' from_pretrained (dtype="auto") records it in
    `model.config.dtype`; float32 when it records none."""
    dtype = getattr(getattr(model, "config", None), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def forward_dtype(module: torch.nn.Module) -> str:
    """The dtype of the module's parameters (a ZeRO-3 one's partitions): what its forward runs in."""
    dtypes = sorted({str(getattr(p, "ds_tensor", p).dtype).replace("torch.", "") for p in module.parameters()
                     if getattr(p, "ds_tensor", p).is_floating_point()})
    return "/".join(dtypes) or "no floating-point parameters"


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
    """On stderr, what this rank holds of a frozen model (tests and people read it: partitioned or whole) and the
    dtype its forward runs in."""
    held, total = held_parameters(module)
    how = " (ZeRO-3 partitioned)" if zero3 else ""
    print(f"dsrecipes: rank {rank}: {what} holds {held:,} of its {total:,} parameters{how}, in "
          f"{forward_dtype(module)}", file=sys.stderr, flush=True)
