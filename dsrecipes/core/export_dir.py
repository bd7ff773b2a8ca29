"""The export directory rule, torch-free: the names a run gives its exports, the marker an export writes, and when a
destination may be written (absent, empty, or an earlier export made only of its own files). The launching process
checks a destination with it before any rank starts; rank/export.py writes through it."""

from __future__ import annotations

import os
import shutil
from fnmatch import fnmatch
from pathlib import Path
from typing import List, Optional

from dsrecipes.core.checkpoint_names import CHECKPOINTS, COMPLETE, PARTIAL
from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import read_json_file
from dsrecipes.core.publish import stale_staging

EXPORT_DIR = "export"
EXPORT_INIT_DIR = "export_init"
EXPORT_MARKER = "dsrecipes_export.json"
# What exports of dsrecipes before the marker listed its files contained (such an export is still replaced).
LEGACY_EXPORT_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                       "tokenizer*", "special_tokens_map.json", "chat_template.jinja", "adapter_*", "vocab.json",
                       "merges.txt", "added_tokens.json", "README.md")
EXPORT_INFO = EXPORT_MARKER  # also where an export came from: run, step, template, an adapter's base model
EXPORT_BEST_DIR = "export_best"  # trainer.save_best: the best evaluated checkpoint's export


def check_out_dir(out_dir: Path, key: str = "export") -> None:
    """Refuse (UserError) a destination that is not absent, empty, or an earlier export made only of its files.
    A filesystem root, or a directory without our marker that holds anything, is refused before its contents are
    listed; an earlier export is listed only up to the first file it did not write."""
    out_dir = Path(out_dir)
    _outside_checkpoints(out_dir, key)
    for parent in [out_dir, *out_dir.parents]:
        if parent.exists():
            if not parent.is_dir():
                where = "is a file" if parent == out_dir else f"lies below {parent}, which is a file"
                raise UserError(f"{key}: {out_dir} {where}; give a directory to write the model to")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"{key}: {parent} is not writable")
            break
    if out_dir.is_dir() and (out_dir == Path(out_dir.anchor) or os.path.ismount(out_dir)):
        raise UserError(f"{key}: {out_dir} is the root of a filesystem; an export goes into a new or empty directory "
                        "(for example a subdirectory of it). Nothing was changed")
    if not out_dir.is_dir() or not _has_entries(out_dir):
        return
    if not (out_dir / EXPORT_MARKER).is_file():
        raise UserError(f"{key}: {out_dir} is not empty and is not a dsrecipes export (no {EXPORT_MARKER}); an export "
                        "goes into a new or empty directory or replaces an earlier export. Nothing was changed")
    written = _written_by_export(out_dir)
    extra = None if written is None else _first_foreign(out_dir, written | {EXPORT_MARKER})
    if written is None or extra:
        what = f"files the export did not write ({', '.join(extra)})" if extra else f"an unreadable {EXPORT_MARKER}"
        raise UserError(f"{key}: {out_dir} holds {what}; replacing it would delete them. Choose another directory "
                        "or move them away. Nothing was changed")


def remove_stale_staging(out_dir: Path) -> List[Path]:
    """What exports to `out_dir` killed mid-write left beside it (`dsrecipes export --out DIR` SIGKILLed, the OOM
    killer: a hidden model-sized `.DIR.tmp-HOST-PID-8hex`), removed; returned. Only what publish.stale_staging finds
    (staging_dir's exact name, this machine's, its process gone), and of that only a directory holding nothing but
    files an export writes: a live export's, another machine's, a file or anything else of that look stays."""
    removed = []
    for stale in stale_staging(out_dir):
        if not _first_foreign(stale, {"*legacy*", EXPORT_MARKER}, limit=1):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale)
    return removed


def _outside_checkpoints(out_dir: Path, key: str) -> None:
    """Refuse a destination inside a checkpoint (a directory holding complete.json, or one being written) or a run's
    checkpoints/ directory itself: an export written there would change what the checkpoint's record signs."""
    where = Path(os.path.abspath(out_dir))
    for parent in [where, *where.parents]:
        checkpoint = (parent / COMPLETE).is_file() or parent.name.endswith(PARTIAL)
        if checkpoint or (parent.name == CHECKPOINTS and (parent.parent / "config.yaml").is_file()):
            raise UserError(f"{key}: {out_dir} lies inside the checkpoints of a run ({parent}); an export written "
                            "there would change a checkpoint. Choose a directory outside it. Nothing was changed")


def _has_entries(directory: Path) -> bool:
    with os.scandir(directory) as it:
        return next(it, None) is not None


def _written_by_export(out_dir: Path) -> Optional[set]:
    """The files an earlier export listed in its marker (older exports: what matches LEGACY_EXPORT_FILES)."""

    try:
        marker = read_json_file(out_dir / EXPORT_MARKER, "nested too deeply")  # bounded: --out may be anyone's
        if "files" in marker:
            return {str(f) for f in marker["files"]}
    except (OSError, ValueError, TypeError):
        return None
    return {"*legacy*"}


def _first_foreign(out_dir: Path, written: set, limit: int = 5) -> List[str]:
    """Up to `limit` files below `out_dir` that are not in `written`, walking no further than needed (the walk
    stops at the first foreign file past `limit`, and never follows symlinks)."""

    legacy = "*legacy*" in written
    foreign: List[str] = []
    for dirpath, dirnames, filenames in os.walk(out_dir):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = Path(dirpath, name).relative_to(out_dir).as_posix()
            ours = rel in written or (legacy and any(fnmatch(rel, p) for p in LEGACY_EXPORT_FILES))
            if not ours:
                foreign.append(rel)
                if len(foreign) >= limit:
                    return foreign
    return foreign


def architectures(model_dir: Path) -> List[str]:
    """config.json's `architectures` of a model directory (bounded read), [] when absent or unreadable (whoever
    loads the directory says why)."""
    try:
        config = read_json_file(Path(model_dir) / "config.json", "config.json nested too deeply")
    except (OSError, ValueError):
        return []
    names = config.get("architectures") if isinstance(config, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def scorer_architecture(model_dir: Path) -> Optional[str]:
    """The architecture of a model directory that scores instead of writing text (every one of config.json's
    `architectures` a `*ForSequenceClassification`: an objective=reward export), else None: chat's and the
    report's question, whatever its number of labels; whether it scores usefully (one label) is
    core/tokenizer.not_a_scorer's, which dsrecipes score and objective.reward_model ask."""
    names = architectures(model_dir)
    return names[0] if names and all(n.endswith("ForSequenceClassification") for n in names) else None


def scorer_refusal(model_dir: Path) -> Optional[str]:
    """Why chat and prompt-eval cannot use `model_dir` (a reward model), or None."""
    arch = scorer_architecture(model_dir)
    if arch is None:
        return None
    return (f"{model_dir}: a reward model ({arch}, as objective=reward exports it) scores answers and does not write "
            f"them, so it cannot chat or answer prompts; score preference pairs with it: dsrecipes score {model_dir} "
            "--pairs PAIRS.jsonl")


def merge_first(model_dir: Path) -> str:
    """'; ...' for a directory that holds a LoRA adapter only (trainer.export_merged_lora=false): what scores is
    the merged model, which `dsrecipes export RUN --lora merged` writes; '' for anything else."""
    model_dir = Path(model_dir)
    if not (model_dir / "adapter_config.json").is_file():
        return ""
    run = model_dir.parent if (model_dir.parent / "config.yaml").is_file() else model_dir
    return (f"; it holds a LoRA adapter only (trainer.export_merged_lora=false): merge it first, dsrecipes export "
            f"{run} --lora merged --out MERGED, and give MERGED")
