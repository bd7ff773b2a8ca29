"""A full disk is a message: recognising that a checkpoint or export ran out of space, and saying how much it needs.

torch.save reports a full disk as a RuntimeError from its zip writer ("unexpected pos", "file write failed") with no
errno, safetensors as a SafetensorError with the OS message as text, so an error while writing counts as out of
space when it carries ENOSPC/EDQUOT, says so in words, or when the filesystem it wrote to is (nearly) full right
after it, while the partial file still holds the space. The caller then removes what
it wrote (the `.partial` checkpoint, the export's temporary directory) and raises `OutOfSpace`, whose message names
the path, the bytes it needs and the bytes free.
"""

from __future__ import annotations

import errno
import gc
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from dsrecipes.core.errors import TrainingFailed, UserError

NEARLY_FULL_BYTES = 64 << 20  # free bytes below which a failed write is taken for a full disk
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class OutOfSpace(TrainingFailed):
    """A checkpoint that did not fit: the run stops (exit 1, result.json failed with this message)."""


class ExportOutOfSpace(UserError):
    """An export that did not fit (`dsrecipes export`: exit 2, nothing left behind)."""


def free_bytes(path: Path) -> Optional[int]:
    for p in [Path(path), *Path(path).parents]:
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def out_of_space(exc: BaseException, path: Path) -> bool:
    """Whether `exc`, raised while writing below `path`, means the filesystem is full."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL:
            return True
        seen = seen.__cause__ or seen.__context__
    if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
        return True  # safetensors' writer: the OS error as text
    free = free_bytes(path)
    return free is not None and free < NEARLY_FULL_BYTES


def tree_bytes(path: Path) -> int:
    """Bytes of the files below `path` (0 when it is gone)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def describe(what: str, path: Path, needed: int, at_least: bool, free: Optional[int]) -> str:
    amount = f"{'at least ' if at_least else 'about '}{needed} bytes ({_human(needed)})"
    have = "" if free is None else f", {free} bytes ({_human(free)}) free there"
    return f"{what}: out of disk space writing {path}: it needs {amount}{have}"


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


def fits(target: Path, write: Callable[[], None]) -> Optional[str]:
    """Run `write`; what went wrong when it ran out of disk space (None when it fitted; any other error is raised).
    The error itself is not kept: its traceback holds the writer whose open file keeps the space allocated."""
    try:
        write()
    except Exception as exc:
        if not out_of_space(exc, target):
            raise
        return f"{type(exc).__name__}: {exc}"
    return None


def abandon_checkpoint(final: Path, staging: Path, previous: Optional[Path]) -> None:
    """Collective, after some rank ran out of space saving `final` into `staging`: rank 0 removes the partial
    directory (once every rank let go of its files), then every rank raises OutOfSpace saying what it needs."""

    import torch.distributed as dist

    written = tree_bytes(staging)
    gc.collect()  # writers left in reference cycles by the failed save close their files (and free the space)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    needed = tree_bytes(previous) if previous is not None else written
    head = describe("checkpoint", final, needed, previous is None, free_bytes(final.parent))
    kept = f"{previous} is intact; free space, then resume from it" if previous else "no earlier checkpoint exists"
    raise OutOfSpace(f"{head}; the partial checkpoint was removed and {kept} (the same command continues the run)",
                     int(final.name.split("_", 1)[1]))
