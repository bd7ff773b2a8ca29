"""Cross-field rules, all in one place. Each returns problems as `dotted.path: message`; nothing is raised here."""

from __future__ import annotations

import os
import re
from typing import Any, List, Optional

from dsrecipes.boundary.batch_script import batch_problems, run_dir_problem
from dsrecipes.boundary.launcher_args import extra_args_problems, hostfile_problems
from dsrecipes.boundary.rank_env import env_problems
from dsrecipes.boundary.values import HOST
from dsrecipes.config.selection_rules import config_problems as selection_problems
from dsrecipes.core import jit_ops
from dsrecipes.core.errors import DataError
from dsrecipes.core.hub import check_hub_paths, is_hub_id
from dsrecipes.core.schema import (
    AttnImpl,
    Device,
    DpoLoss,
    LauncherKind,
    ObjectiveKind,
    OffloadDevice,
    OptimizerKind,
    Precision,
    ReferenceMode,
    ResumeMode,
    RowKind,
    TrainConfig,
)
from dsrecipes.data.sources.files import expand_paths, no_file
from dsrecipes.data.sources.remote import check_url, expand, looks_like_url
from dsrecipes.data.strategies.rules import caches_reference, carries_pairs, config_problems, required_paths
from dsrecipes.objectives.base import reference_mode

_SLOTS = r"[A-Za-z0-9_.-]{1,253}(?::\d{1,4}(?:,\d{1,4})*)?"  # deepspeed --include/--exclude: host[:slots]@...
_HOST_SLOTS = re.compile(f"{_SLOTS}(?:@{_SLOTS})*", re.ASCII)  # ASCII digits only (issue 50)
_ENDPOINT = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:]{2,45}\])(?::\d{1,5})?", re.ASCII)



def validate(cfg: TrainConfig, *, check_files: bool = True) -> List[str]:
    """Every rule violation in `cfg`. `check_files=False` skips existence checks of user paths (`validate --all`)."""
    errors: List[str] = []
    errors += _zero_and_offload(cfg)
    errors += _batch(cfg)
    errors += _data(cfg)
    errors += _misc(cfg)
    errors += selection_problems(cfg)  # evaluation, save_best, early stopping (dsrecipes/rank/selection.py)
    errors += _objective(cfg)
    if check_files:
        errors += _files(cfg)
    return errors


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
    for name in ("micro_batch_size", "grad_accum", "epochs", "log_every", "keep_checkpoints", "nan_max_skips"):
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
    if t.resume is ResumeMode.never and t.resume_from is not None:
        errors.append("trainer.resume_from: set, but trainer.resume=never starts from step 0; drop one of them")
    m = cfg.model
    for key, lr in (("optimizer.lr", cfg.optimizer.lr), ("model.finetune_lr", m.finetune_lr),
                    ("model.lora.finetune_lr", m.lora.finetune_lr), ("model.tiny.finetune_lr", m.tiny.finetune_lr)):
        if lr is not None and lr <= 0:
            errors.append(f"{key}: must be > 0, got {lr}")
    if len(cfg.optimizer.betas) != 2:
        errors.append(f"optimizer.betas: needs two values, got {cfg.optimizer.betas}")
    if cfg.scheduler.warmup_steps < 0:
        errors.append(f"scheduler.warmup_steps: must be >= 0, got {cfg.scheduler.warmup_steps}")
    if not 0.0 <= cfg.scheduler.min_lr_ratio <= 1.0:
        errors.append(f"scheduler.min_lr_ratio: must be in [0, 1], got {cfg.scheduler.min_lr_ratio}")
    return errors


def _data(cfg: TrainConfig) -> List[str]:
    d, ds = cfg.data, cfg.dataset
    errors = []
    if d.cutoff_len < 8:
        errors.append(f"data.cutoff_len: must be >= 8, got {d.cutoff_len}")
    if d.num_workers < 0:
        errors.append(f"data.num_workers: must be >= 0, got {d.num_workers}")
    if d.preprocess_workers < 1:
        errors.append(f"data.preprocess_workers: must be >= 1, got {d.preprocess_workers}")
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
    for i, src in enumerate(ds.sources):
        if not src.paths:
            errors.append(f"dataset.sources[{i}].paths: empty")
        if src.weight <= 0:
            errors.append(f"dataset.sources[{i}].weight: must be > 0, got {src.weight}")
    return errors


def _objective(cfg: TrainConfig) -> List[str]:
    """Objectives on pairs (`objective.rows=pair`): data that carries pairs, without packing (a pair is one sample of
    two sequences), a positive beta; a precomputed reference only where the strategy caches one; DPO: a label
    smoothing its loss defines."""
    o, errors = cfg.objective, []
    if o.rows is not RowKind.pair:
        return errors
    name = f"objective={o.kind.value}"
    if not carries_pairs(cfg):
        errors.append(f"data.kind: data={cfg.data.kind.value} does not carry preference pairs ({name})")
    elif reference_mode(cfg) is ReferenceMode.precomputed and not caches_reference(cfg):
        errors.append(f"objective.reference: precomputed reference log-probs are cached with the prepared pairs of "
                      f"data=map; data={cfg.data.kind.value} reads each pair only on the rank that trains on it, so "
                      "there is no pass before training to compute them in. Set objective.reference=live (with "
                      "LoRA: the base model with its adapters disabled, no second copy), or use data=map")
    if cfg.data.packing:
        errors.append(f"data.packing: {name} trains on whole pairs; set data.packing=false")
    if not o.beta > 0:
        errors.append(f"objective.beta: must be > 0, got {o.beta}")
    if o.kind is ObjectiveKind.dpo:
        errors += _dpo(o)
    return errors


def _dpo(o: Any) -> List[str]:
    errors = []
    top = 0.5 if o.loss is DpoLoss.robust else 1.0
    if not 0 <= o.label_smoothing < top:
        errors.append(f"objective.label_smoothing: must be in [0, {top}) for objective.loss={o.loss.value}, "
                      f"got {o.label_smoothing}")
    if o.loss is DpoLoss.ipo and o.label_smoothing:
        errors.append("objective.label_smoothing: objective.loss=ipo has no label smoothing; use sigmoid or robust")
    if o.loss is DpoLoss.simpo and o.reference is ReferenceMode.live:
        errors.append("objective.reference: objective.loss=simpo uses no reference model; drop objective.reference=live")
    if not o.simpo_gamma >= 0:
        errors.append(f"objective.simpo_gamma: must be >= 0, got {o.simpo_gamma}")
    return errors


def _misc(cfg: TrainConfig) -> List[str]:
    errors = []
    lora = cfg.model.lora
    if lora.enabled and (lora.r < 1 or lora.alpha < 1):
        errors.append("model.lora.r: rank and alpha must be >= 1")
    if lora.enabled and not lora.target_modules:
        errors.append("model.lora.target_modules: empty")
    ln = cfg.launcher
    if ln.num_gpus is not None and ln.num_gpus < 1:
        errors.append(f"launcher.num_gpus: must be >= 1, got {ln.num_gpus}")
    if ln.peer_timeout_s < 0 or 0 < ln.peer_timeout_s < 5:
        errors.append(f"launcher.peer_timeout_s: 0 (off) or >= 5 seconds, got {ln.peer_timeout_s}")
    if ln.num_nodes < 1:
        errors.append(f"launcher.num_nodes: must be >= 1, got {ln.num_nodes}")
    if ln.kind is LauncherKind.deepspeed and (ln.include or ln.exclude) and ln.num_gpus is not None:
        errors.append(
            f"launcher.{'include' if ln.include else 'exclude'}: deepspeed cannot combine --include/--exclude with --num_gpus; "
            "set launcher.num_gpus=null when selecting devices"
        )
    if ln.include and ln.exclude:
        errors.append("launcher.exclude: use launcher.include or launcher.exclude, not both")
    if ln.kind is LauncherKind.local and ((ln.num_gpus or 1) > 1 or ln.num_nodes > 1):
        errors.append("launcher.kind: the local launcher runs one process; use launcher=deepspeed for several")
    if not 0 <= ln.node_rank < ln.num_nodes:
        errors.append(f"launcher.node_rank: must be in [0, {ln.num_nodes}), got {ln.node_rank}")
    errors += _launcher(ln)
    errors += launcher_boundary_problems(ln)
    if ln.kind is LauncherKind.slurm and cfg.trainer.output_dir:
        errors += [p for p in [run_dir_problem(os.path.abspath(os.path.expanduser(cfg.trainer.output_dir)))] if p]
    if cfg.model.trust_remote_code:
        errors.append("model.trust_remote_code: must stay false; a model or tokenizer directory's own Python code "
                      "is never run (configs and downloads are data); use a model transformers supports natively")
    return errors


def launcher_env_problems(env: dict) -> List[str]:
    """launcher.env entries outside the documented table (boundary/rank_env.py) or with a value not of its type."""

    return env_problems(env)


def launcher_boundary_problems(ln) -> List[str]:
    """What a config would put on a command line, into the ranks' environment or into a batch script, checked
    against the boundary's positive lists (every refused item named)."""

    problems = extra_args_problems(ln.kind, list(ln.extra_args)) + launcher_env_problems(ln.env) + batch_problems(ln)
    if HOST.check(str(ln.master_addr)):
        problems.append(f"launcher.master_addr: needs {HOST.expected}, got {ln.master_addr!r}")
    for key in ("include", "exclude"):
        value = getattr(ln, key)
        if value is not None and not _HOST_SLOTS.fullmatch(str(value)):
            problems.append(f"launcher.{key}: needs hosts and slots such as 'localhost:0,1' or 'node1@node2:0', "
                            f"got {value!r}")
    if ln.rdzv_endpoint is not None and not _ENDPOINT.fullmatch(str(ln.rdzv_endpoint)):
        problems.append(f"launcher.rdzv_endpoint: needs HOST or HOST:PORT, got {ln.rdzv_endpoint!r}")
    if ln.hostfile is not None and any(c in str(ln.hostfile) for c in "\n\r\0"):
        problems.append("launcher.hostfile: the path holds a line break or NUL")
    return problems


def _launcher(ln) -> List[str]:
    errors = []
    multi = ln.num_nodes > 1
    if (ln.include or ln.exclude) and ln.kind is not LauncherKind.deepspeed:
        key = "launcher.include" if ln.include else "launcher.exclude"
        errors.append(f"{key}: --include/--exclude exist only for launcher=deepspeed, not {ln.kind.value}")
    if ln.kind is LauncherKind.deepspeed and multi and not ln.hostfile:
        errors.append("launcher.hostfile: launcher=deepspeed on several nodes needs a hostfile "
                      "(or use launcher=deepspeed_multinode for the no-ssh mode)")
    if ln.kind in (LauncherKind.deepspeed_multinode, LauncherKind.slurm) and ln.num_gpus is None:
        errors.append(f"launcher.num_gpus: launcher={ln.kind.value} starts ranks on other machines, so say how many "
                      "per node (this machine's device count is not theirs)")
    if ln.kind is LauncherKind.torchrun and multi and not ln.rdzv_endpoint and ln.master_addr in ("127.0.0.1", "localhost"):
        errors.append("launcher.rdzv_endpoint: torchrun on several nodes needs a rendezvous host:port "
                      "(or launcher.master_addr set to node 0's address)")
    if ln.kind is LauncherKind.mpirun and multi and not ln.hostfile:
        errors.append("launcher.hostfile: mpirun on several nodes needs a hostfile")
    if ln.master_port is not None and not 1 <= ln.master_port <= 65535:
        errors.append(f"launcher.master_port: must be in 1..65535, got {ln.master_port}")
    if ln.slurm_time_min < 1:
        errors.append(f"launcher.slurm_time_min: must be >= 1, got {ln.slurm_time_min}")
    return errors


def _files(cfg: TrainConfig) -> List[str]:
    named = [(f"dataset.paths[{i}]", p) for i, p in enumerate(cfg.dataset.paths)]
    named += [(f"dataset.val_paths[{i}]", p) for i, p in enumerate(cfg.dataset.val_paths)]
    for i, src in enumerate(cfg.dataset.sources):
        named += [(f"dataset.sources[{i}].paths[{j}]", p) for j, p in enumerate(src.paths)]
    errors = []
    for key, pattern in named:
        try:
            if expand_paths([pattern])[1]:
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
    if cfg.launcher.hostfile and os.path.isfile(os.path.expanduser(cfg.launcher.hostfile)):
        errors += hostfile_problems(cfg.launcher.hostfile)
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
