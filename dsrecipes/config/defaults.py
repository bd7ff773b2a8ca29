"""Derived defaults: values that follow from other keys. Not part of `load_config` (the default composition stays
the bare schema): the launching process applies `with_derived_defaults` before it writes config.yaml (resolve.py),
so a run directory holds the concrete values; commands that read a composed config directly call what they need.

- `optimizer.lr: null` (the optimizer groups' default) is the model's own learning rate (`learning_rate`):
  `model.tiny.finetune_lr` (3e-3) for the embedded tiny model, else `model.finetune_lr` for a full fine-tune and
  `model.lora.finetune_lr` with LoRA. Model groups set those for their model (schema defaults 2e-5 and 2e-4, which
  also apply to `model.path=...` on the default group), so `model=NAME` alone trains at a sensible rate; an explicit
  `optimizer.lr=...` wins. (Named `finetune_lr`, not `lr`, so `trainer.lr` still suggests `optimizer.lr`.)
- `model.name` still "tiny" (the default group) while `model.path` names another model: the path's last part
  (`/models/Qwen2.5-0.5B-Instruct` -> `Qwen2.5-0.5B-Instruct`, a hub id as it is), so logs and `estimate` name the
  model being trained. `~` in model paths is expanded (transformers does not).
- relative data paths (`dataset.paths`, `dataset.sources[i].paths`, `dataset.registry`) become absolute, so the run's
  config.yaml means the same files from any working directory (ranks, `prompt-eval` reading the validation split).

`config_warnings` names legal but probably unintended settings (a tiny-model learning rate on a pretrained model);
`lr_note` says where the learning rate came from when `optimizer.lr` is unset (the launch prints it), so a run
after one at another rate never trains at the model's rate unannounced.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import PurePath
from typing import List, Optional

from dsrecipes.core.hub import is_hub_id
from dsrecipes.core.schema import OptimizerKind, TrainConfig

TINY_NAME = "tiny"
HIGH_LR = 1e-3  # above this, adaptive optimizers tend to wreck a pretrained model


def learning_rate(cfg: TrainConfig) -> float:
    """The learning rate a run uses: `optimizer.lr`, or the model's own when that is null."""
    if cfg.optimizer.lr is not None:
        return cfg.optimizer.lr
    if cfg.model.path is None:
        return cfg.model.tiny.finetune_lr
    return cfg.model.lora.finetune_lr if cfg.model.lora.enabled else cfg.model.finetune_lr


def lr_source(cfg: TrainConfig) -> str:
    """The key `learning_rate(cfg)` reads: optimizer.lr, or the model's own rule's key."""
    if cfg.optimizer.lr is not None:
        return "optimizer.lr"
    if cfg.model.path is None:
        return "model.tiny.finetune_lr"
    return "model.lora.finetune_lr" if cfg.model.lora.enabled else "model.finetune_lr"


def lr_note(cfg: TrainConfig) -> Optional[str]:
    """`learning rate: 2e-05 from model.finetune_lr (...); optimizer.lr=VALUE sets another`, None when the
    command chose it (optimizer.lr set). Call it before `with_derived_defaults`, which fills optimizer.lr in."""
    if cfg.optimizer.lr is not None:
        return None
    what = {"model.tiny.finetune_lr": "the embedded tiny model's rate",
            "model.lora.finetune_lr": f"{model_name(cfg)}'s LoRA rate",
            "model.finetune_lr": f"{model_name(cfg)}'s full fine-tuning rate"}[lr_source(cfg)]
    return (f"learning rate: {learning_rate(cfg):g} from {lr_source(cfg)} ({what}; optimizer.lr is unset); "
            "optimizer.lr=VALUE sets another")


def model_name(cfg: TrainConfig) -> str:
    path = cfg.model.path
    if not path or cfg.model.name != TINY_NAME:
        return cfg.model.name

    return path if is_hub_id(path) else PurePath(os.path.expanduser(path).rstrip("/")).name or path


def with_derived_defaults(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the values above filled in (a new config)."""
    m, ds = cfg.model, cfg.dataset
    model = dataclasses.replace(m, name=model_name(cfg), path=local_dir(m.path), tokenizer_path=local_dir(m.tokenizer_path))
    sources = [dataclasses.replace(s, paths=_absolute(s.paths)) for s in ds.sources]
    registry = _absolute([ds.registry])[0] if ds.registry else ds.registry
    dataset = dataclasses.replace(ds, paths=_absolute(ds.paths), val_paths=_absolute(ds.val_paths), sources=sources,
                                  registry=registry)
    optimizer = dataclasses.replace(cfg.optimizer, lr=learning_rate(cfg))
    return dataclasses.replace(cfg, model=model, dataset=dataset, optimizer=optimizer)


def local_dir(path):
    """An existing local directory made absolute (the run's config.yaml, its "train further" and resume commands and
    `dsrecipes export/chat RUN` then work from any directory); a hub id, or a path that is not there, as typed."""
    if not path:
        return path
    path = os.path.expanduser(path)
    return os.path.abspath(path) if os.path.isdir(path) else path


def _absolute(paths: List[str]) -> List[str]:
    """Local paths made absolute; URLs (`s3://...`, `hf://...`, data/sources/remote.py) kept as written."""
    return [p if "://" in p else os.path.abspath(os.path.expanduser(p)) for p in paths]


def config_warnings(cfg: TrainConfig) -> List[str]:
    """Legal but probably unintended settings (printed by the launch, never fatal)."""
    lr = learning_rate(cfg)
    out = []
    if cfg.model.path and lr > HIGH_LR and cfg.optimizer.name is not OptimizerKind.sgd:
        out.append(f"optimizer.lr: {lr:g} is a learning rate for the embedded tiny model; a pretrained model "
                   f"({model_name(cfg)}) usually fine-tunes at ~1e-5..5e-5 (full) or ~1e-4..3e-4 (LoRA). "
                   "Leave optimizer.lr unset to use the model group's model.finetune_lr / model.lora.finetune_lr")
    t = cfg.trainer
    if t.max_steps is not None and t.epochs != 1:  # LLaMA-Factory's num_train_epochs is the budget there
        out.append(f"trainer.epochs: {t.epochs} is unused: trainer.max_steps={t.max_steps} sets the run's length; "
                   f"trainer.max_steps=null trains {t.epochs} epochs")
    return out
