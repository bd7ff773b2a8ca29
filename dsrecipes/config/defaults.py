"""Derived defaults: values that follow from other keys. Not part of `load_config` (the default composition stays
the bare schema): the launching process applies `with_derived_defaults` before it writes config.yaml (resolve.py),
so a run directory holds the concrete values; commands that read a composed config directly call what they need.

- `optimizer.lr: null` (the optimizer groups' default) is the model's own learning rate for the objective
  (`learning_rate`): for a pretrained model (`model.path` set) `model.finetune_lr` for a full fine-tune or
  `model.lora.finetune_lr` with LoRA, times `objective.lr_scale` (1 for sft and reward; 0.1 for dpo and grpo,
  whose updates start from an SFT'd policy, and orpo, often run on the base model but tuned as low: TRL's defaults
  are 2e-5 for SFT and 1e-6 for DPO/GRPO/ORPO). Model groups set
  those rates for their model (schema defaults 2e-5 and 2e-4, which also apply to `model.path=...` on the default
  group), so `model=NAME objective=dpo` alone trains at a sensible rate. The embedded tiny model (no `model.path`:
  random init, nothing to preserve) trains at `model.tiny.finetune_lr` (3e-3) for every objective, unscaled. An
  explicit `optimizer.lr=...` wins, unscaled. (Named `finetune_lr`, not `lr`, so `trainer.lr` still suggests
  `optimizer.lr`.) config.yaml holds the concrete rate, which the ranks read and never scale again; a resume derives
  the same rate (the model and objective keys, lr_scale included, must match the checkpoint's: run/resume_contract).
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

from dsrecipes.config.matrix import option_body
from dsrecipes.core.hub import is_hub_id
from dsrecipes.core.schema import OptimizerKind, TrainConfig

TINY_NAME = "tiny"
HIGH_LR = 1e-3  # above this, adaptive optimizers tend to wreck a pretrained model


def learning_rate(cfg: TrainConfig) -> float:
    """The learning rate a run uses: `optimizer.lr` as set, or the model's own rate x `lr_scale_applied(cfg)` when
    it is null (the embedded tiny model's rate unscaled, for every objective)."""
    if cfg.optimizer.lr is not None:
        return cfg.optimizer.lr
    scale = lr_scale_applied(cfg)
    rate = model_rate(cfg)
    # 5e-05 x 0.1 is 5.000000000000001e-06 in binary; config.yaml and `show` hold 5e-06
    return rate if scale is None else float(f"{rate * scale:.12g}")


def model_rate(cfg: TrainConfig) -> float:
    """The model's own rate (before any objective.lr_scale): the value of the key `_model_key` names."""
    if cfg.model.path is None:
        return cfg.model.tiny.finetune_lr
    return cfg.model.lora.finetune_lr if cfg.model.lora.enabled else cfg.model.finetune_lr


def lr_scale_applied(cfg: TrainConfig) -> Optional[float]:
    """`objective.lr_scale` when `learning_rate` multiplies by it (optimizer.lr unset, a pretrained model, a scale
    other than 1), else None."""
    if cfg.optimizer.lr is not None or cfg.model.path is None or cfg.objective.lr_scale == 1.0:
        return None
    return cfg.objective.lr_scale


def _model_key(cfg: TrainConfig) -> str:
    if cfg.model.path is None:
        return "model.tiny.finetune_lr"
    return "model.lora.finetune_lr" if cfg.model.lora.enabled else "model.finetune_lr"


def lr_source(cfg: TrainConfig) -> str:
    """The keys `learning_rate(cfg)` reads: `optimizer.lr`, the model's rate key (`model.finetune_lr`, ...), or
    `model.finetune_lr x objective.lr_scale` when the objective scales it."""
    if cfg.optimizer.lr is not None:
        return "optimizer.lr"
    return _model_key(cfg) + (" x objective.lr_scale" if lr_scale_applied(cfg) is not None else "")


def lr_note(cfg: TrainConfig) -> Optional[str]:
    """`learning rate: 5e-06 from model.finetune_lr x objective.lr_scale (SmolLM2-135M-Instruct's full fine-tuning
    rate 5e-05 x 0.1 for dpo; optimizer.lr is unset); optimizer.lr=VALUE sets another`, None when the command chose
    it (optimizer.lr set). Call it before `with_derived_defaults`, which fills optimizer.lr in."""
    if cfg.optimizer.lr is not None:
        return None
    return (f"learning rate: {learning_rate(cfg):g} from {lr_source(cfg)} ({lr_reason(cfg)}; optimizer.lr is "
            "unset); optimizer.lr=VALUE sets another")


def lr_reason(cfg: TrainConfig) -> str:
    """Where an unset optimizer.lr's rate comes from, in words: `SmolLM2-135M-Instruct's LoRA rate 0.0003 x 0.1 for
    dpo`, `the embedded tiny model's rate, random init: objective.lr_scale 0.1 is not applied`."""
    scale, kind = lr_scale_applied(cfg), cfg.objective.kind.value
    if cfg.model.path is None:
        tiny = cfg.objective.lr_scale != 1.0
        return "the embedded tiny model's rate" + (
            f", random init: objective.lr_scale {cfg.objective.lr_scale:g} is not applied" if tiny else "")
    what = f"{model_name(cfg)}'s {'LoRA' if cfg.model.lora.enabled else 'full fine-tuning'} rate"
    return what if scale is None else f"{what} {model_rate(cfg):g} x {scale:g} for {kind}"


def objective_lr_scale(kind: str) -> float:
    """The objective group's own `lr_scale` (conf/objective/KIND.yaml): a run that leaves it as its objective sets
    it is not warned that an explicit optimizer.lr makes it unused (`config_warnings`)."""
    return float(option_body("objective", kind).get("lr_scale", 1.0))


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
                   "Leave optimizer.lr unset to use the model group's model.finetune_lr / model.lora.finetune_lr "
                   "(x objective.lr_scale)")
    scale = cfg.objective.lr_scale
    if cfg.optimizer.lr is not None and scale not in (1.0, objective_lr_scale(cfg.objective.kind.value)):
        out.append(f"objective.lr_scale: {scale:g} is unused: optimizer.lr={cfg.optimizer.lr:g} sets the rate as it "
                   "is (lr_scale multiplies the model's finetune_lr only when optimizer.lr is unset)")
    t = cfg.trainer
    if t.max_steps is not None and t.epochs != 1:  # LLaMA-Factory's num_train_epochs is the budget there
        out.append(f"trainer.epochs: {t.epochs} is unused: trainer.max_steps={t.max_steps} sets the run's length; "
                   f"trainer.max_steps=null trains {t.epochs} epochs")
    return out
