"""Cross-field rules, collected in one place. Each returns problems as `dotted.path: message`; nothing is raised here.

The rules of one launcher, one objective or one data strategy live in their tables (config/launcher_rules.py,
config/objective_rules.py, data/strategies/rules.py); this module runs them all and holds the rules between groups."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, List, Optional

from dsrecipes.boundary.launcher_args import hostfile_problems
from dsrecipes.boundary.rank_env import env_problems
from dsrecipes.config.launcher_rules import launcher_problems
from dsrecipes.config.objective_rules import objective_problems
from dsrecipes.config.selection_rules import config_problems as selection_problems
from dsrecipes.core import jit_ops
from dsrecipes.core.errors import DataError
from dsrecipes.core.hub import check_hub_paths, is_hub_id
from dsrecipes.core.schema import (
    AttnImpl,
    Device,
    OffloadDevice,
    OptimizerKind,
    Precision,
    ResumeMode,
    RowKind,
    TrainConfig,
)
from dsrecipes.data.shard.manifest import read_manifest
from dsrecipes.data.sources.files import expand_paths, no_file
from dsrecipes.data.sources.preference import pairs_as_problems
from dsrecipes.data.sources.remote import check_url, expand, looks_like_url
from dsrecipes.data.sources.split_shares import split_problems
from dsrecipes.data.strategies.rules import config_problems, reads_parquet, required_paths
from dsrecipes.objectives.rewards import reward_model_problems


def validate(cfg: TrainConfig, *, check_files: bool = True) -> List[str]:
    """Every rule violation in `cfg`. `check_files=False` skips existence checks of user paths (`validate --all`).
    A NaN or infinite number anywhere is reported alone: the rules below compare and round numbers."""
    errors: List[str] = non_finite(cfg)
    if errors:
        return errors
    errors += _zero_and_offload(cfg)
    errors += _batch(cfg)
    errors += _data(cfg)
    errors += _misc(cfg)
    errors += launcher_problems(cfg)  # shared and per launcher (config/launcher_rules.py)
    errors += selection_problems(cfg)  # evaluation, save_best, early stopping (dsrecipes/rank/selection.py)
    errors += objective_problems(cfg)  # per row kind and per objective (config/objective_rules.py)
    if check_files:
        errors += _files(cfg)
    return errors


MAX_INT = 2**63 - 1
MAX_WORKERS = 1024  # data.num_workers (per rank), data.preprocess_workers: processes, past any machine's cores
MAX_CUTOFF = 1 << 24  # data.cutoff_len: 16M tokens per sample, past any model's context


def non_finite(value: Any, key: str = "") -> List[str]:
    """`key: must be a finite number, got nan` for every NaN/inf float in the config (no key takes one: a learning
    rate of nan trains nothing, a timeout of inf never ends, and every `x > 0` rule lets NaN through), and every
    whole number past 64 bits (data.cutoff_len=10^20 was a numpy casting traceback in data preparation)."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [f"{key}: must be a finite number, got {value}"]
    if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT <= value <= MAX_INT:
        return [f"{key}: {value} does not fit in 64 bits (numpy and torch count in them)"]
    if dataclasses.is_dataclass(value):
        items: Any = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        return [e for i, v in enumerate(value) for e in non_finite(v, f"{key}[{i}]")]
    else:
        return []
    return [e for k, v in items for e in non_finite(v, f"{key}.{k}" if key else str(k))]


def _zero_and_offload(cfg: TrainConfig) -> List[str]:
    errors = []
    stage = cfg.zero.stage
    if stage not in (0, 1, 2, 3):
        errors.append(f"zero.stage: must be 0, 1, 2 or 3, got {stage}")
    if cfg.offload.param is not OffloadDevice.none and stage != 3:
        errors.append(
            f"offload.param: parameter offload ({cfg.offload.param.value}) needs ZeRO-3, but zero.stage={stage} "
            "(use zero=stage3, or offload=cpu_optimizer)"
        )
    if cfg.offload.optimizer is not OffloadDevice.none and stage < 1:
        errors.append(
            f"offload.optimizer: optimizer offload ({cfg.offload.optimizer.value}) needs ZeRO >= 1, but zero.stage=0"
        )
    uses_nvme = OffloadDevice.nvme in (cfg.offload.param, cfg.offload.optimizer)
    if uses_nvme and not cfg.offload.nvme_path:
        errors.append("offload.nvme_path: NVMe offload needs a directory on a fast local disk")
    if cfg.model.lora.enabled and cfg.offload.param is not OffloadDevice.none:
        errors.append("model.lora.enabled: LoRA with parameter offload is not supported; use offload=cpu_optimizer")
    return errors


def _batch(cfg: TrainConfig) -> List[str]:
    t = cfg.trainer
    errors = []
    errors += micro_batch_problems(cfg)
    for name in ("grad_accum", "epochs", "log_every", "keep_checkpoints", "nan_max_skips"):
        if getattr(t, name) < 1:
            errors.append(f"trainer.{name}: must be >= 1, got {getattr(t, name)}")
    if t.max_steps is not None and t.max_steps < 1:
        errors.append(f"trainer.max_steps: must be >= 1 (or null to train for trainer.epochs), got {t.max_steps}")
    for name in ("save_every", "eval_every"):
        if getattr(t, name) < 0:
            errors.append(f"trainer.{name}: must be >= 0 (0 = only at the end), got {getattr(t, name)}")
    if t.stop_grace_s <= 0:
        errors.append(f"trainer.stop_grace_s: must be > 0 seconds, got {t.stop_grace_s}")
    if t.gradient_clipping < 0:
        errors.append(f"trainer.gradient_clipping: must be >= 0 (0 disables), got {t.gradient_clipping}")
    if t.ce_chunk_tokens < 0:
        errors.append(f"trainer.ce_chunk_tokens: must be >= 0 (0 = full logits), got {t.ce_chunk_tokens}")
    if t.resume is ResumeMode.never and t.resume_from is not None:
        errors.append("trainer.resume_from: set, but trainer.resume=never starts from step 0; drop one of them")
    m = cfg.model
    for key, lr in (("optimizer.lr", cfg.optimizer.lr), ("model.finetune_lr", m.finetune_lr),
                    ("model.lora.finetune_lr", m.lora.finetune_lr), ("model.tiny.finetune_lr", m.tiny.finetune_lr)):
        if lr is not None and lr <= 0:
            errors.append(f"{key}: must be > 0, got {lr}")
    if not 0 < cfg.objective.lr_scale <= 1:  # a share of the model's rate (config/defaults.py learning_rate)
        errors.append(f"objective.lr_scale: must be in (0, 1] (the share of the model's finetune_lr this objective "
                      f"trains at when optimizer.lr is unset), got {cfg.objective.lr_scale}")
    if len(cfg.optimizer.betas) != 2:
        errors.append(f"optimizer.betas: needs two values, got {cfg.optimizer.betas}")
    if cfg.scheduler.warmup_steps < 0:
        errors.append(f"scheduler.warmup_steps: must be >= 0, got {cfg.scheduler.warmup_steps}")
    ratio = cfg.scheduler.warmup_ratio
    if ratio is not None and not 0.0 <= ratio < 1.0:
        errors.append(f"scheduler.warmup_ratio: must be in [0, 1) (a share of the run's steps), got {ratio}")
    if not 0.0 <= cfg.scheduler.min_lr_ratio <= 1.0:
        errors.append(f"scheduler.min_lr_ratio: must be in [0, 1], got {cfg.scheduler.min_lr_ratio}")
    return errors


def micro_batch_problems(cfg: TrainConfig) -> List[str]:
    """trainer.micro_batch_size: a whole number >= 1, or "auto" (run/micro_batch.py: probes SFT's rows)."""
    size = cfg.trainer.micro_batch_size
    if size == "auto":
        if cfg.objective.rows is RowKind.conversation:
            return []
        return [f"trainer.micro_batch_size: auto probes conversation rows (objective=sft), not "
                f"objective={cfg.objective.kind.value}'s {cfg.objective.rows.value} rows; set a number"]
    if isinstance(size, bool) or not isinstance(size, int):
        return [f"trainer.micro_batch_size: must be an integer >= 1 or 'auto' (the largest that fits), got {size!r}"]
    return [] if size >= 1 else [f"trainer.micro_batch_size: must be >= 1, got {size}"]


def _data(cfg: TrainConfig) -> List[str]:
    d, ds = cfg.data, cfg.dataset
    errors = []
    if not 8 <= d.cutoff_len <= MAX_CUTOFF:
        errors.append(f"data.cutoff_len: must be from 8 to {MAX_CUTOFF} tokens, got {d.cutoff_len}")
    if not 0 <= d.num_workers <= MAX_WORKERS:  # more is a fork of every one (audit simulated 10^11 for ever)
        errors.append(f"data.num_workers: must be from 0 to {MAX_WORKERS} (DataLoader processes per rank), "
                      f"got {d.num_workers}")
    if not 1 <= d.preprocess_workers <= MAX_WORKERS:
        errors.append(f"data.preprocess_workers: must be from 1 to {MAX_WORKERS} (processes), got "
                      f"{d.preprocess_workers}")
    if d.shuffle_buffer < 0:
        errors.append(f"data.shuffle_buffer: must be >= 0, got {d.shuffle_buffer}")
    for key in ("block_bytes", "chunk_bytes"):
        if getattr(d, key) is not None and getattr(d, key) < 1:
            errors.append(f"data.{key}: must be >= 1 (or null: automatic), got {getattr(d, key)}")
    for key in ("read_ahead_bytes", "span_bytes"):
        if getattr(d, key) < 1:
            errors.append(f"data.{key}: must be >= 1, got {getattr(d, key)}")
    if d.num_samples is not None and d.num_samples < 1:
        errors.append(f"data.num_samples: must be >= 1 (or null: the stream's count), got {d.num_samples}")
    errors += config_problems(cfg)  # what the data strategy needs (data/strategies/rules.py)
    if ds.use and not ds.registry:
        errors.append("dataset.registry: dataset.use names registry entries, so a registry file is needed")
    if ds.val_size < 0 or (ds.val_size >= 1 and ds.val_size != int(ds.val_size)):
        errors.append(f"dataset.val_size: a fraction in [0, 1) or a whole number of samples, got {ds.val_size}")
    if not 0.0 <= ds.max_bad_fraction <= 1.0:
        errors.append(f"dataset.max_bad_fraction: must be in [0, 1], got {ds.max_bad_fraction}")
    if ds.max_row_bytes < 64:
        errors.append(f"dataset.max_row_bytes: must be >= 64 (bytes of one row), got {ds.max_row_bytes}")
    if ds.max_samples is not None and ds.max_samples < 1:
        errors.append(f"dataset.max_samples: must be >= 1, got {ds.max_samples}")
    errors += split_problems(ds, d.kind)  # dataset.split (data/sources/split_shares.py)
    errors += pairs_as_problems(ds, cfg.objective.rows)  # dataset.pairs_as (data/sources/preference.py)
    for i, src in enumerate(ds.sources):
        if not src.paths:
            errors.append(f"dataset.sources[{i}].paths: empty")
        if src.weight <= 0:
            errors.append(f"dataset.sources[{i}].weight: must be > 0, got {src.weight}")
    return errors


def _misc(cfg: TrainConfig) -> List[str]:
    errors = []
    lora = cfg.model.lora
    if lora.enabled and (lora.r < 1 or lora.alpha < 1):
        errors.append("model.lora.r: rank and alpha must be >= 1")
    if lora.enabled and not lora.target_modules:
        errors.append("model.lora.target_modules: empty")
    if cfg.model.trust_remote_code:
        errors.append("model.trust_remote_code: must stay false; a model or tokenizer directory's own Python code "
                      "is never run (configs and downloads are data); use a model transformers supports natively")
    return errors


def launcher_env_problems(env: dict) -> List[str]:
    """launcher.env entries outside the documented table (boundary/rank_env.py) or with a value not of its type."""
    return env_problems(env)


def _files(cfg: TrainConfig) -> List[str]:
    named = [(f"dataset.paths[{i}]", p) for i, p in enumerate(cfg.dataset.paths)]
    named += [(f"dataset.val_paths[{i}]", p) for i, p in enumerate(cfg.dataset.val_paths)]
    for i, src in enumerate(cfg.dataset.sources):
        named += [(f"dataset.sources[{i}].paths[{j}]", p) for j, p in enumerate(src.paths)]
    errors = []
    for key, pattern in named:
        try:
            if expand_paths([pattern], parquet=reads_parquet(cfg))[1]:
                errors.append(f"{key}: {no_file(pattern)}")
        except DataError as exc:  # a store that cannot be asked (credentials, network, bucket, scheme)
            errors.append(f"{key}: {exc}")
    checks = [
        ("dataset.registry", cfg.dataset.registry),
        ("model.path", cfg.model.path),
        ("model.tokenizer_path", cfg.model.tokenizer_path),
        ("launcher.hostfile", cfg.launcher.hostfile),
        ("trainer.resume_from", cfg.trainer.resume_from),
    ]
    checks += required_paths(cfg)
    for key, path in checks:
        if key == "data.shard_dir" and path and looks_like_url(path):
            errors += _shard_url(path)
            continue
        if path and not os.path.exists(os.path.expanduser(path)) and not (key.startswith("model.") and is_hub_id(path)):
            errors.append(f"{key}: {path!r} does not exist")
        elif key == "data.shard_dir" and path:  # the check the run makes first: not a directory, no manifest, ...
            try:
                read_manifest(path)
            except DataError as exc:
                errors += exc.problems
    for key, path in (("launcher.hostfile", cfg.launcher.hostfile), ("dataset.registry", cfg.dataset.registry)):
        where = os.path.expanduser(path) if path else ""
        if where and os.path.isdir(where) and key == "dataset.registry":  # LLaMA-Factory's dataset_dir is a folder
            inside = os.path.join(path.rstrip("/"), "dataset_info.json")
            errors.append(f"{key}: {path!r} is a folder; name the registry file in it: {key}={inside}")
        elif where and os.path.exists(where) and not os.path.isfile(where):  # a FIFO would block its reader
            errors.append(f"{key}: {path!r} is not a regular file")
    if cfg.launcher.hostfile and os.path.isfile(os.path.expanduser(cfg.launcher.hostfile)):
        errors += hostfile_problems(cfg.launcher.hostfile)
    if cfg.objective.reward_model:  # objective=grpo's scorer directory (a pipeline's is an export made later)
        errors += reward_model_problems(cfg.objective.reward_model)
    return errors + check_hub_paths(cfg)


def _shard_url(url: str) -> List[str]:
    problem = check_url(url.rstrip("/") + "/manifest.json")
    if problem:
        return [f"data.shard_dir: {problem}"]
    try:
        found = expand(url.rstrip("/") + "/manifest.json")
    except DataError as exc:
        return [f"data.shard_dir: {exc}"]
    return [] if found else [f"data.shard_dir: {url!r} holds no manifest.json (written by `dsrecipes shard`)"]


def check_runtime(cfg: TrainConfig, *, cuda_available: bool, async_io: Optional[bool] = None) -> List[str]:
    """Rules that depend on the machine a run starts on (not part of `validate`, which must accept GPU recipes).

    `async_io`: whether DeepSpeed can build its async I/O op here (None: asked of DeepSpeed, only when the config
    offloads to NVMe; jit_ops.async_io_buildable)."""
    errors = []
    if cfg.precision.dtype is Precision.fp16 and not cuda_available:
        errors.append(
            "precision.dtype: fp16 needs a CUDA GPU and none is available here "
            "(DeepSpeed: 'Type fp16 is not supported on your device'); use precision=bf16 or precision=fp32"
        )
    if cfg.trainer.micro_batch_size == "auto" and not cuda_available:
        errors.append("trainer.micro_batch_size: auto is a GPU-only choice (a probe finds the largest micro-batch "
                      "that fits GPU memory) and this machine has no CUDA GPU; set a number, e.g. "
                      "trainer.micro_batch_size=8")
    if cfg.trainer.device is Device.cuda and not cuda_available:
        errors.append("trainer.device: cuda requested but no CUDA GPU is available")
    if cfg.model.attn_implementation is AttnImpl.flash_attention_2 and not cuda_available:
        errors.append("model.attn_implementation: flash_attention_2 needs a CUDA GPU; use sdpa")
    if cfg.optimizer.name is OptimizerKind.lion and cfg.offload.optimizer is OffloadDevice.none and not cuda_available:
        errors.append("optimizer.name: lion without optimizer offload is DeepSpeed's FusedLion, a CUDA kernel "
                      "('This op had not been implemented on CPU backend'); on CPU use offload=cpu_optimizer "
                      "(DeepSpeedCPULion, needs zero=stage1 or higher) or another optimizer")
    nvme = [k for k in ("optimizer", "param") if getattr(cfg.offload, k) is OffloadDevice.nvme]
    if nvme and not (jit_ops.async_io_buildable() if async_io is None else async_io):
        # Refused here: a rank would first JIT-build DeepSpeed's pin_memory op (minutes of C++) and then fail on
        # async_io ('async_io' op not compatible) in every rank.
        errors.append(f"offload.{nvme[0]}: nvme offload needs DeepSpeed's async_io op, which cannot be built on this "
                      "machine: libaio is missing (apt install libaio-dev; `dsrecipes doctor` checks it)")
    return errors
