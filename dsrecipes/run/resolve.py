"""What the launching process decides once about the model, before it writes the run directory.

- derived defaults: the model's learning rate (said on the console when it comes from the model's rule, not from
  optimizer.lr) and name, absolute data paths (config/defaults.py);
- hub ids in `model.path` / `model.tokenizer_path` -> local snapshot directories (hub.py);
- `template=auto` -> the concrete template for this tokenizer (data/render/template_choice.py);
- bf16 on a GPU without it (pre-Ampere) -> fp16, said on the console (large-model presets default to bf16;
  DeepSpeed's CPU accelerator supports bf16, so CPU runs keep it, with a note where the CPU computes it slowly);
- warnings about legal but probably unintended choices: a high learning rate on a pretrained model
  (config/defaults.py), a template that renders differently from the model's own (template_choice.py).

The result goes into `<run>/config.yaml`, so ranks, export, prompt-eval and chat read local paths and a concrete
template and never decide again.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import List, Tuple

from dsrecipes.config.defaults import config_warnings, lr_note, with_derived_defaults
from dsrecipes.core.hub import resolve_hub_paths
from dsrecipes.core.schema import Device, Precision, TemplateKind, TrainConfig
from dsrecipes.core.tokenizer import load_tokenizer
from dsrecipes.data.render.template_choice import choose_template, template_warnings


def resolve_model_choices(cfg: TrainConfig) -> Tuple[TrainConfig, List[str]]:
    """(config with local model paths and a concrete template, warnings)."""

    cfg = resolve_hub_paths(with_derived_defaults(cfg))  # the name comes from a hub id before it becomes a path
    warnings = config_warnings(cfg)
    if cfg.model.path is None and cfg.template.name is TemplateKind.auto:
        return dataclasses.replace(cfg, template=dataclasses.replace(cfg.template, name=TemplateKind.chatml)), warnings
    if cfg.model.path is not None:

        tokenizer = load_tokenizer(cfg)
        template = choose_template(cfg.template, tokenizer, cfg.model.path)
        warnings += template_warnings(template, tokenizer)
        cfg = dataclasses.replace(cfg, template=template)
    return cfg, warnings


def precision_for_device(cfg: TrainConfig, gpu: str | None, native_bf16: bool) -> Tuple[TrainConfig, str | None]:
    """bf16 where the device computes it; on a GPU without it (`gpu` names the GPU the run uses, None: CPU) fp16,
    with the note that says so. A CPU keeps bf16 either way (DeepSpeed's CPU accelerator trains in it), but one
    without fast bf16 (no AVX-512 or Arm BF16) emulates its matmuls, several times slower than fp32: a note says so
    and names the faster choice; the run's precision stays what the config says."""
    if cfg.precision.dtype is not Precision.bf16 or native_bf16:
        return cfg, None
    if gpu is None:
        return cfg, ("precision: bf16 on a CPU without fast bf16 (oneDNN reports none: no AVX-512 or Arm BF16, or "
                     "a torch without oneDNN): its matmuls are emulated, often several times slower than fp32; "
                     "precision=fp32 trains faster here")
    note = (f"precision: {gpu} has no bf16; training in fp16 instead (precision=fp16 or precision=fp32 chooses "
            "without this note)")
    return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, dtype=Precision.fp16)), note


def _this_device(cfg: TrainConfig) -> Tuple[str | None, bool]:
    """(the GPU's name, None on CPU; whether that device computes bf16 natively)."""
    import torch

    if cfg.trainer.device is Device.cpu or not torch.cuda.is_available():
        return None, cpu_has_native_bf16()
    return torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls fast (oneDNN's check: AVX-512 BW/VL/DQ, which AVX512-BF16 and AMX
    extend, or Arm's BF16). True when
    it cannot be told (an older torch without the check): no note rather than a wrong one."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def prepare_launch(cfg: TrainConfig) -> TrainConfig:
    """`resolve_model_choices`, printing what was chosen and the warnings (stderr)."""
    chosen, warnings = resolve_model_choices(cfg)
    chosen, note = precision_for_device(chosen, *_this_device(chosen))
    for said in (note, lr_note(cfg)):  # lr_note: where the learning rate came from, when optimizer.lr is unset
        if said:
            print(said, file=sys.stderr)
    if cfg.template.name is TemplateKind.auto:
        print(f"template: auto -> {chosen.template.name.value}", file=sys.stderr)
    if chosen.model.path != cfg.model.path:
        print(f"model.path: {cfg.model.path} -> {chosen.model.path}", file=sys.stderr)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return chosen
