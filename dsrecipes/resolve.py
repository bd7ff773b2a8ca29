"""What the launching process decides once about the model, before it writes the run directory.

- derived defaults: the model's learning rate and name, absolute data paths (config/defaults.py);
- hub ids in `model.path` / `model.tokenizer_path` -> local snapshot directories (hub.py);
- `template=auto` -> the concrete template for this tokenizer (data/template_choice.py);
- warnings about legal but probably unintended choices: a high learning rate on a pretrained model
  (config/defaults.py), a template that renders differently from the model's own (template_choice.py).

The result goes into `<run>/config.yaml`, so ranks, export, prompt-eval and chat read local paths and a concrete
template and never decide again.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import List, Tuple

from dsrecipes.config.defaults import config_warnings, with_derived_defaults
from dsrecipes.config.schema import TemplateKind, TrainConfig
from dsrecipes.hub import resolve_hub_paths


def resolve_model_choices(cfg: TrainConfig) -> Tuple[TrainConfig, List[str]]:
    """(config with local model paths and a concrete template, warnings)."""
    from dsrecipes.data.template_choice import choose_template, template_warnings

    cfg = resolve_hub_paths(with_derived_defaults(cfg))  # the name comes from a hub id before it becomes a path
    warnings = config_warnings(cfg)
    if cfg.model.path is None and cfg.template.name is TemplateKind.auto:
        return dataclasses.replace(cfg, template=dataclasses.replace(cfg.template, name=TemplateKind.chatml)), warnings
    if cfg.model.path is not None:
        from dsrecipes.model import load_tokenizer

        tokenizer = load_tokenizer(cfg)
        template = choose_template(cfg.template, tokenizer, cfg.model.path)
        warnings += template_warnings(template, tokenizer)
        cfg = dataclasses.replace(cfg, template=template)
    return cfg, warnings


def prepare_launch(cfg: TrainConfig) -> TrainConfig:
    """`resolve_model_choices`, printing what was chosen and the warnings (stderr)."""
    chosen, warnings = resolve_model_choices(cfg)
    if cfg.template.name is TemplateKind.auto:
        print(f"template: auto -> {chosen.template.name.value}", file=sys.stderr)
    if chosen.model.path != cfg.model.path:
        print(f"model.path: {cfg.model.path} -> {chosen.model.path}", file=sys.stderr)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return chosen
