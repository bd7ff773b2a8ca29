"""File lists with sizes and cheap content hashes: written last as a commit record, verified before anything trusts
the files (checkpoints: complete.json).

A checkpoint of a large model is tens to hundreds of GB, so hashing every byte at each save would cost minutes.
Small files (JSON, RNG states, configs) are hashed whole; a large file is identified by its size plus a hash of three
1 MiB windows (start, middle, end). That catches what actually happens to checkpoints (a save cut short, a truncated
copy, a file replaced by another run's, an empty or rewritten JSON file), at a few MB read per file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Dict, Iterable, Optional

WHOLE_FILE_BYTES = 4 << 20  # files up to this size are hashed completely
WINDOW_BYTES = 1 << 20


def file_digest(path: Path, size: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        if size <= WHOLE_FILE_BYTES:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        else:
            for offset in (0, size // 2 - WINDOW_BYTES // 2, size - WINDOW_BYTES):
                fh.seek(offset)
                h.update(fh.read(WINDOW_BYTES))
    return h.hexdigest()


def describe(root: Path, skip: Iterable[str] = ()) -> Dict[str, Dict[str, object]]:
    """{relative path: {"size": bytes, "hash": digest}} for every file below `root` (sorted; `skip`: names at the
    top level to leave out, e.g. the record itself)."""
    root = Path(root)
    skipped = set(skip)
    files: Dict[str, Dict[str, object]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel in skipped:
                continue
            size = path.stat().st_size
            files[rel] = {"size": size, "hash": file_digest(path, size)}
    return files


def verify(root: Path, files: Dict[str, Dict[str, object]]) -> Optional[str]:
    """None when every listed file is there with its size and hash; else the first problem, naming the file."""
    root = Path(root)
    for rel, want in sorted(files.items()):
        path = root / rel
        try:
            size = path.stat().st_size
        except OSError:
            return f"{rel}: missing"
        if size != want.get("size"):
            return f"{rel}: {size} bytes, {want.get('size')} when it was written (truncated or replaced)"
        try:
            digest = file_digest(path, size)
        except OSError as exc:
            return f"{rel}: unreadable ({exc.strerror or exc})"
        if digest != want.get("hash"):
            return f"{rel}: content differs from when it was written"
    return None


def unlisted(root: Path, files: Dict[str, Dict[str, object]], ignore: Iterable[str] = ()) -> Optional[str]:
    """The first file below `root` that `files` does not list (`ignore`: top-level names left out, e.g. the record
    itself): a file added after the commit, which a loader globbing for shards would read unverified."""
    root = Path(root)
    ignored = set(ignore)
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in ignored]
        dirnames.sort()
        for name in sorted(filenames):
            rel = (rel_dir / name).as_posix()
            if rel not in files and rel not in ignored:
                return f"{rel}: not part of the checkpoint as it was written (added later)"
    return None
