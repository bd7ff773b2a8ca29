"""Which config changes a resume accepts: checked by the launching process before it writes anything.

A checkpoint holds weights, optimizer state and a data position that only mean something for the settings that
wrote them. Resuming with another model, LoRA setting, optimizer type, template, cutoff, packing, seed or different
training data would load state into the wrong shapes (a traceback deep in DeepSpeed) or, worse, train silently on
a mixture. Those keys must equal the checkpoint's (`MUST_MATCH`); the data must have the same fingerprint (file
contents and preparation, data/prepare/cache.py). Everything that only changes how long, how often, where, with how many
processes or in which batch shape a run continues may change (`MAY_CHANGE`; the data position is global, see
README "Data strategies"), and is reported in one line.

Every leaf key of TrainConfig is classified by its longest listed prefix; a key listed nowhere must match (a new
setting is unsafe until someone decides otherwise; tests/test_resume_contract.py fails for unlisted keys). A key
added after a run started is absent from its config.yaml: it compares as the value that run trained as
(legacy_keys.py, which also says how to resume it), not as a difference.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextvars import ContextVar
from typing import AbstractSet, Any, Dict, List, Optional, Tuple

import dsrecipes.run.legacy_keys as legacy_keys
from dsrecipes.core.errors import NothingToTrain, Refused
from dsrecipes.run.data_change import UNKNOWN, DataChange, explain, rendering_changed

MUST_MATCH = (
    "model", "template", "dataset", "data.kind", "data.cutoff_len", "data.packing", "data.train_on", "data.shuffle",
    "data.shuffle_buffer", "data.num_samples", "data.block_bytes", "data.chunk_bytes",
    "optimizer.name", "optimizer.torch_adam",
    "precision.dtype", "zero.stage", "scheduler.name", "trainer.seed", "objective",
    "trainer.save_best.metric", "trainer.save_best.mode",  # the best so far (in the checkpoint) is in these terms
)
MAY_CHANGE = (
    "model.name", "model.attn_implementation", "model.gradient_checkpointing", "model.num_params", "model.arch",
    "data.num_workers", "data.prefetch_factor", "data.read_ahead_bytes", "data.span_bytes", "data.preprocess_workers",
    "data.cache_dir", "data.prescan", "data.read_deadline_s",
    "data.shard_dir", "optimizer.lr", "optimizer.weight_decay", "optimizer.betas", "optimizer.eps",
    "optimizer.momentum", "precision.loss_scale", "precision.initial_scale_power", "precision.loss_scale_window",
    "zero.overlap_comm", "zero.contiguous_gradients", "zero.reduce_bucket_size", "zero.allgather_bucket_size",
    "zero.stage3_prefetch_bucket_size", "zero.stage3_param_persistence_threshold", "zero.stage3_max_live_parameters",
    "zero.stage3_gather_16bit_weights_on_model_save", "offload", "scheduler.warmup_steps", "scheduler.warmup_ratio",
    "scheduler.min_lr_ratio",
    "trainer.max_steps", "trainer.epochs", "trainer.micro_batch_size", "trainer.grad_accum", "trainer.save_every",
    "trainer.eval_every", "trainer.eval_batches", "trainer.eval_samples", "trainer.eval_at_start",
    "trainer.save_best.enabled", "trainer.early_stopping", "trainer.prompt_eval_every", "trainer.prompt_eval_samples",
    "trainer.prompt_eval_max_new_tokens", "trainer.log_every", "trainer.keep_checkpoints", "trainer.resume", "trainer.resume_from", "trainer.output_dir",
    "trainer.record_samples", "trainer.ce_chunk_tokens", "trainer.gradient_clipping", "trainer.export", "trainer.export_merged_lora",
    "trainer.device", "trainer.nan_policy", "trainer.nan_max_skips", "trainer.stop_grace_s", "trainer.report_to",
    "trainer.experiment", "trainer.tracking_uri", "launcher",
)


def flatten(data: Any, prefix: str = "") -> Dict[str, Any]:
    """{"a.b.c": leaf} for nested dicts; lists are leaves."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: Dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def may_change(key: str) -> bool:
    """True when `key` may differ between a checkpoint and the run resuming it (longest listed prefix decides)."""
    best, verdict = -1, False
    for table, allowed in ((MUST_MATCH, False), (MAY_CHANGE, True)):
        for prefix in table:
            if (key == prefix or key.startswith(prefix + ".")) and len(prefix) > best:
                best, verdict = len(prefix), allowed
    return verdict


def listed(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in MUST_MATCH + MAY_CHANGE)


def identity_fingerprint(config: Dict[str, Any]) -> str:
    """A digest of the settings a resume must keep (the run marker records it)."""
    keep = {k: v for k, v in sorted(flatten(config).items()) if not may_change(k)}
    return hashlib.blake2b(json.dumps(keep, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


def compare(saved: Dict[str, Any], new: Dict[str, Any]) -> Tuple[List[str], List[str]]:
    """(changes that cannot resume, changes that can), each as `key: old -> new`; a key the saved config lacks
    compares as its legacy value (`key: absent (... trained as X) -> new`)."""
    return _compare(saved, new)[:2]


def _compare(saved: Dict[str, Any], new: Dict[str, Any]) -> Tuple[List[str], List[str], List[str]]:
    """compare's two lists and the legacy keys among the refused ones."""
    as_started, filled = legacy_keys.as_started(saved)
    old_flat, new_flat, saved_flat = flatten(as_started), flatten(new), flatten(saved)
    refused, accepted, legacy = [], [], []
    for key in sorted(set(old_flat) | set(new_flat)):
        if key not in saved_flat and key not in new_flat:
            continue  # a legacy value filled in for a key neither side has (a partial config): no difference
        old, now = old_flat.get(key, "<absent>"), new_flat.get(key, "<absent>")
        if old == now or (key in LOCAL_DIRS and _same_dir(old, now)):
            continue
        row = legacy_keys.filled_row(key, filled)
        if row is None:
            line = f"{key}: {_show(old)} -> {_show(now)}"
        else:
            line = legacy_keys.describe(key, row, filled, now)
        (accepted if may_change(key) else refused).append(line)
        if row is not None and not may_change(key):
            legacy.append(row)
    return refused, accepted, legacy


RESTORE_TAIL = "Restore them to resume, or start a new run in another trainer.output_dir"
# The last line of a refusal to resume (`check`) where the data's change has no remedy of its own: train's; a
# pipeline's stage, whose trainer.output_dir is the pipeline's, is refused with the pipeline's (run/pipeline.py sets
# it around each stage)
RESUME_REMEDY: ContextVar[str] = ContextVar("RESUME_REMEDY", default=f"{RESTORE_TAIL} (nothing was changed)")

LOCAL_DIRS = ("model.path", "model.tokenizer_path")  # absolute since config/defaults.local_dir; relative in older runs


def _same_dir(old: Any, now: Any) -> bool:
    """A relative directory recorded by a run started before model paths were made absolute, resumed from the same
    working directory: the same directory as the absolute one recorded now."""
    return (isinstance(old, str) and isinstance(now, str) and not os.path.isabs(old) and os.path.isabs(now)
            and os.path.abspath(os.path.expanduser(old)) == now)


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def check(saved: Dict[str, Any], new: Dict[str, Any], saved_data: Optional[str], new_data: str,
          checkpoint: str, data: Optional[DataChange] = None,
          explicit: AbstractSet[str] = frozenset()) -> Optional[str]:
    """Raise ConfigError listing every difference that cannot resume from `checkpoint` (a differing data
    fingerprint with what changed, `data_change.explain`; for keys added after the run started, the overrides that
    resume it as it started: `explicit`, the keys the command line sets, words it); else return the one-line report
    of the accepted differences (None when there are none)."""

    refused, accepted, legacy = _compare(saved, new)
    ignorable = {"trainer.output_dir", "trainer.resume_from", "trainer.resume"}  # how one says "resume", not what
    accepted = [a for a in accepted if a.split(":", 1)[0] not in ignorable]
    remedy, settings = None, bool(refused)
    rendered = rendering_changed(data) if saved_data is not None and saved_data == new_data else None
    if saved_data is not None and saved_data != new_data:
        what, remedy = explain(data, settings) if data is not None else (UNKNOWN, None)
        refused.append(f"training data: fingerprint {saved_data} -> {new_data} ({what})")
    elif rendered is not None:
        what, remedy = rendered
        refused.append(f"training data: {what}")
    if refused:
        lines = "\n".join(f"  {r}" for r in refused)
        said = legacy_keys.remedy(legacy, legacy_keys.as_started(saved)[1], set(explicit)) if legacy else ""
        differ = ("these settings differ from the ones it was trained with" if settings else
                  "the training data differs from the data it was trained on")
        raise Refused(
            f"cannot resume {checkpoint}: {differ}, and a checkpoint only continues correctly under its own:\n"
            f"{lines}\n"
            + (f"{remedy[0].upper() + remedy[1:]} (nothing was changed)" if remedy and not settings else
               RESUME_REMEDY.get())
            + (f"\n{said}" if said else ""))
    if not accepted:
        return None
    return f"resuming {checkpoint} with changed settings: " + ", ".join(accepted)


def check_budget(checkpoint: str, step: int, total: int, record: Dict[str, Any], saved: Dict[str, Any],
                 new: Dict[str, Any], finished: bool) -> bool:
    """Whether this resume trains past an early stop (the checkpoint's complete.json `stopped_early`, with a larger
    budget than that segment's or other `trainer.early_stopping` settings): the rank then forgets the stop.
    Refused (exit 2, nothing written, result.json kept) when the run that wrote the checkpoint `finished` (its
    result.json: ok, at that step) and this one would train no step: a budget at or below `step`, or the same
    budget and early stopping after an early stop. An unfinished end (killed while exporting) is completed."""
    stopped = record.get("stopped_early")
    if total <= step:
        if finished:
            raise NothingToTrain(f"nothing to train: {checkpoint} has done {step} optimizer steps and this run plans "
                          f"{total}; {_raise_budget(step, flatten(new))} to train further; nothing was changed")
        return False
    if not stopped:
        return False
    stopping = [flatten(saved).get(f"trainer.early_stopping.{k}") for k in ("patience", "min_delta")]
    if total > int(record.get("total_steps") or total) or stopping != [
            flatten(new).get(f"trainer.early_stopping.{k}") for k in ("patience", "min_delta")]:
        return True
    if finished:
        raise NothingToTrain(f"nothing to train: {checkpoint} stopped early ({stopped}), and this run's budget ({total} "
                      "steps) and early stopping are that segment's, so it would stop there again. To train past "
                      f"it, set trainer.early_stopping.patience=0 (train up to step {total}) or a larger "
                      "trainer.max_steps; nothing was changed")
    return False


def _raise_budget(step: int, new: Dict[str, Any]) -> str:
    """What to raise: an epoch-based run's budget (trainer.max_steps null: LLaMA-Factory's num_train_epochs) is
    trainer.epochs, and a trainer.max_steps the user never wrote would be a surprise there."""
    epochs = new.get("trainer.epochs")
    if new.get("trainer.max_steps") is None and isinstance(epochs, int):
        return (f"raise trainer.epochs above {epochs} (e.g. trainer.epochs={2 * epochs}), or set trainer.max_steps "
                f"above {step}")
    return f"raise trainer.max_steps above {step} (e.g. trainer.max_steps={2 * step})"
