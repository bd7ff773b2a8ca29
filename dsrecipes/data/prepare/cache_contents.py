"""The content record of a cache directory (prepared data, reference log-probs): written when the directory is
published, verified each time a run uses it (issue 50 item 3).

`seal(dir)` hashes every byte of every regular file under `dir` (blake2b) into `dir/contents.json`, the last file
written before the directory is published (core/publish.py). `check(dir)` re-hashes and compares before a run trusts
the cache: a changed, missing, extra or linked file is refused with one message naming it and the directory to
delete, so poisoned tokens or foreign reference log-probs are never trained on silently. Whole-file hashes, not the
sampled windows of core/manifest.py: a single changed token in the middle of an Arrow file must be caught. `skip`
names subdirectories with records of their own (a prepared directory's `reference/`).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Dict, Iterable

from dsrecipes.core.errors import DataError
from dsrecipes.core.fileio import atomic_write_json, read_json_file

CONTENTS = "contents.json"
BLOCK = 1 << 20


def seal(directory: Path, skip: Iterable[str] = ()) -> None:
    """Write `directory/contents.json`: {relative path: {"size", "blake2b"}} of every file under it."""
    atomic_write_json(Path(directory) / CONTENTS, {"files": _describe(Path(directory), set(skip))})


def check(directory: Path, skip: Iterable[str] = ()) -> None:
    """Raise DataError naming the first file that differs from `contents.json` (or the record, when it is missing or
    unreadable); return when every file is as published."""
    directory = Path(directory)
    fix = f"delete {directory} and start the run again to rebuild it"
    try:
        recorded = read_json_file(directory / CONTENTS, "JSON nested too deeply")["files"]  # a FIFO: no wait
        if not isinstance(recorded, dict):
            raise ValueError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{directory / CONTENTS}: no readable content record of this cache ({exc}); {fix}") from None
    found = _describe(directory, set(skip))
    for rel in sorted(set(recorded) | set(found)):
        want, got = recorded.get(rel), found.get(rel)
        if want != got:
            what = ("is missing" if got is None else "is not in the record written when the cache was published"
                    if want is None else "changed after the cache was published (its content hash differs)")
            raise DataError(f"{directory / rel}: {what} ({CONTENTS}); {fix}")


def _describe(root: Path, skip: set) -> Dict[str, Dict[str, object]]:
    out: Dict[str, Dict[str, object]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in skip]
        for name in sorted(filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]):
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel == CONTENTS:
                continue
            out[rel] = _entry(Path(dirpath) / name)
    return out


def _entry(path: Path) -> Dict[str, object]:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return {"size": st.st_size, "blake2b": "not a regular file"}
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(BLOCK), b""):
            h.update(block)
    return {"size": st.st_size, "blake2b": h.hexdigest()}
