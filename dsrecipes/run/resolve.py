"""What the launching process decides once about the model, before it writes the run directory.

- derived defaults: the model's learning rate (said on the console when it comes from the model's rule, not from
  optimizer.lr) and name, absolute data paths (config/defaults.py);
- hub ids in `model.path` / `model.tokenizer_path` -> local snapshot directories (hub.py);
- `template=auto` -> the concrete template for this tokenizer (data/render/template_choice.py);
- bf16 on a GPU without it (pre-Ampere) -> fp16, said on the console (large-model presets default to bf16;
  DeepSpeed's CPU accelerator supports bf16, so CPU runs keep it);
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


def precision_for_device(cfg: TrainConfig, gpu: str | None, gpu_has_bf16: bool) -> Tuple[TrainConfig, str | None]:
    """bf16 where the device has it; on a GPU without it (`gpu` names the GPU the run uses, None: CPU) fp16, with
    the note that says so."""
    if cfg.precision.dtype is not Precision.bf16 or gpu is None or gpu_has_bf16:
        return cfg, None
    note = (f"precision: {gpu} has no bf16; training in fp16 instead (precision=fp16 or precision=fp32 chooses "
            "without this note)")
    return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, dtype=Precision.fp16)), note


def _this_device(cfg: TrainConfig) -> Tuple[str | None, bool]:
    import torch

    if cfg.trainer.device is Device.cpu or not torch.cuda.is_available():
        return None, True
    return torch.cuda.get_device_name(0), torch.cuda.is_bf16_supported()


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
