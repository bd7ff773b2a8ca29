"""Publishing a finished directory: the one way checkpoints, exports, shards and prepared data appear.

Owns: making a staging directory beside a target and turning it into the target in one step. The final path always
names a complete directory - the new one, or (until the swap) the previous one - never nothing and never half of one:

- the target is absent or an empty directory: one `rename` onto it (a directory that gained entries meanwhile makes
  the rename fail with ENOTEMPTY, never a merge);
- it holds a previous version and the caller replaces it: the two are exchanged in one step (Linux `renameat2`
  RENAME_EXCHANGE); the previous version is then in the staging path, and the caller removes what it wrote there
  (a checkpoint its whole directory, a shard the files its manifest listed);
- it holds the same content already (content-addressed caches: another process finished the same key first):
  ours is discarded.

Where RENAME_EXCHANGE is unavailable (ENOSYS, or EINVAL on a file system without it) the exchange falls back to
three renames (previous aside, new in, aside to the staging path), with a window in which the final path is absent;
the previous directory is put back when the second rename fails.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import uuid
from enum import Enum
from pathlib import Path
from typing import List, Optional


class Existing(str, Enum):
    """What `publish_dir` does when the target already holds a non-empty directory."""

    exchange = "exchange"  # replace it; the previous directory is returned (in the staging path)
    keep = "keep"  # it is the same content (a cache key): discard ours
    refuse = "refuse"  # raise FileExistsError; nothing changed


def staging_dir(target: Path, tag: str = "tmp") -> Path:
    """A new, uniquely named hidden directory beside `target` (same file system, so it can be renamed onto it).
    The parent must exist: callers that make parents record them with `fileio.missing_dirs` first."""
    target = Path(target)
    new = target.parent / f".{target.name}.{tag}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    new.mkdir()
    return new


def _host() -> str:
    """This machine's name as a staging name carries it (letters, digits, '-', at most 32): on a file system other
    machines share, `stale_staging` only judges the directories of processes of this one."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def stale_staging(target: Path, tag: str = "tmp") -> List[Path]:
    """The staging directories `staging_dir` made beside `target` for processes of this machine that are gone (killed
    mid-write: SIGKILL, the OOM killer), by that exact name only (this host's name in it); a live or unknown
    process's, and any other machine's (its pids mean nothing here: a run directory on a shared file system), are left
    alone."""
    target = Path(target)
    pattern = re.compile(rf"\.{re.escape(target.name)}\.{re.escape(tag)}-{re.escape(_host())}-(\d+)-[0-9a-f]{{8}}")
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and not entry.is_symlink() and entry.is_dir() and not _alive(int(match.group(1))):
            found.append(entry)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM), a pid out of range: not known to be gone
        return True
    return True


def publish_dir(staging: Path, target: Path, existing: Existing = Existing.refuse) -> Optional[Path]:
    """Make the complete directory `staging` the directory `target` (see the module docstring). Returns the path now
    holding the previous version after an exchange, else None. `staging` no longer exists after `keep`."""
    staging, target = Path(staging), Path(target)
    try:
        os.rename(staging, target)
        return None
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if existing is Existing.refuse:
            raise FileExistsError(errno.EEXIST, "a directory with contents is already there", str(target)) from None
    if existing is Existing.keep:
        shutil.rmtree(staging, ignore_errors=True)
        return None
    exchange(staging, target)
    return staging


def exchange(new: Path, old: Path) -> None:
    """Swap two directories in one step (RENAME_EXCHANGE: `old` never goes missing); see the module docstring for
    the fallback."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(old), rename_exchange) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), str(old))
    aside = staging_dir(old, "old")
    os.rename(old, aside)  # onto the empty directory just made
    try:
        os.rename(new, old)
    except OSError:
        os.rename(aside, old)
        raise
    os.rename(aside, new)
