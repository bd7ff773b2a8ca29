"""A checkpoint's names and commit record, torch-free: where tags live (`checkpoints/step_<N>`), what marks one
complete (`complete.json`), and the order commits happened in. The launching process reads these to decide a resume;
the ranks (rank/checkpoint.py) write them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from dsrecipes.core.fileio import read_json_file
from dsrecipes.core.rundir import CHECKPOINTS_DIR

CHECKPOINTS = CHECKPOINTS_DIR
LATEST = "latest"
COMPLETE = "complete.json"
UNIVERSAL = "universal"
PARTIAL = ".partial"  # suffix of a tag directory being written
REPLACED = ".replaced"  # suffix of an old tag directory while a re-save swaps it out
MAX_WORLD_SIZE = 1 << 20  # more ranks than any run has had: a record saying so is not one we wrote


def tag_for(step: int) -> str:
    return f"step_{step}"


def step_of(tag_dir: Path) -> int:
    return int(tag_dir.name.split("_", 1)[1])


def read_record(tag_dir: Path) -> Dict[str, Any]:
    """complete.json of a checkpoint; ValueError/OSError when it is missing or not a commit record. Read within
    fileio's bounds (never a FIFO's endless wait, never a giant file whole, no RecursionError)."""
    record = read_json_file(Path(tag_dir) / COMPLETE, "not a checkpoint commit record (JSON nested too deeply)")
    if not isinstance(record, dict) or not all(_whole(record.get(k), low) for k, low in (("step", 0), ("world_size", 1))):
        raise ValueError("not a checkpoint commit record (step and world_size must be whole numbers)")
    size = record["world_size"]
    if size > MAX_WORLD_SIZE:  # (a resume at another world size would plan for that many ranks)
        shown = size if size < 10**12 else f"of {len(str(size))} digits"
        raise ValueError(f"not a checkpoint commit record (world_size {shown} is more than {MAX_WORLD_SIZE} ranks)")
    return record


def _whole(value: Any, low: int) -> bool:
    """A JSON whole number >= low (not true/false, not 1e999 read back as infinity)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def commit_order(tag_dir: Path) -> tuple:
    """(commit time, step): the record's `saved_at`; for a record without one (older versions, or unreadable), when
    complete.json was last written."""
    try:
        saved_at = float(read_record(tag_dir).get("saved_at") or 0.0)
    except (OSError, ValueError, TypeError):  # TypeError: a foreign record's list or object where the time belongs
        saved_at = 0.0
    if not saved_at:
        try:
            saved_at = (tag_dir / COMPLETE).stat().st_mtime
        except OSError:
            saved_at = 0.0
    return (saved_at, step_of(tag_dir))
