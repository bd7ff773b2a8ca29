"""File lists with sizes and cheap content hashes: written last as a commit record, verified before anything trusts
the files (checkpoints: complete.json).

A checkpoint of a large model is tens to hundreds of GB, so hashing every byte at each save would cost minutes.
Small files (JSON, RNG states, configs) are hashed whole; a large file is identified by its size plus a hash of three
1 MiB windows (start, middle, end). That catches what actually happens to checkpoints (a save cut short, a truncated
copy, a file replaced by another run's, an empty or rewritten JSON file), at a few MB read per file.

A list read back may come from someone else's record (a checkpoint trusted with --trust-checkpoint), so `verify` and
`unlisted` first check that it has the shape `describe` writes (`shape_problem`: every entry a plain relative path
with an integer size and a string hash) and read only regular files whose real path lies inside the directory: a
list naming `/etc/...`, `../...` or a link out of the directory is a problem to report, never a file to read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Dict, Iterable, Optional

WHOLE_FILE_BYTES = 4 << 20  # files up to this size are hashed completely
WINDOW_BYTES = 1 << 20
LISTING = "complete.json: files"  # what messages call a list unless the caller names it: a checkpoint's record
ENTRY = '{"size": bytes, "hash": digest}'


def file_digest(path: Path, size: int) -> str:
    with open(path, "rb") as fh:
        return fd_digest(fh.fileno(), size)


def fd_digest(fd: int, size: int) -> str:
    """The digest of the file open as `fd` (read with pread: the descriptor's position is left alone), so a loader
    can hash exactly the file it then loads from the same descriptor (boundary/point_of_use.py)."""
    h = hashlib.blake2b(digest_size=16)
    if size <= WHOLE_FILE_BYTES:
        offset = 0
        while True:
            block = os.pread(fd, 1 << 20, offset)
            if not block:
                break
            h.update(block)
            offset += len(block)
    else:
        for offset in (0, size // 2 - WINDOW_BYTES // 2, size - WINDOW_BYTES):
            h.update(os.pread(fd, WINDOW_BYTES, offset))
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


def plain_relative(rel: object) -> bool:
    """True for a path as `describe` writes it: printable names joined by "/", none of them empty, "." or "..", so
    it is relative and names something below the directory it is joined to."""
    return isinstance(rel, str) and all(name not in ("", ".", "..") and name.isprintable() for name in rel.split("/"))


def _got(value: object) -> str:
    """How a message shows a value of the wrong type: a number, true/false or null as it reads in JSON (cut short),
    anything else by its type (a string from someone else's record is not echoed)."""
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)[:24]
    return type(value).__name__


def shape_problem(files: object, listing: str = LISTING) -> Optional[str]:
    """None when `files` has the shape `describe` writes ({plain relative path: {"size": int >= 0, "hash": str}}),
    else the first thing wrong, naming the entry (`listing`: what messages call the list, its record and key)."""
    if not isinstance(files, dict):
        return f"{listing}: expected {{path: {ENTRY}}}, got {_got(files)}"
    for rel in sorted(files, key=str):
        entry = files[rel]
        where = f"{listing}[{json.dumps(str(rel))}]"
        if not plain_relative(rel):
            return (f"{where}: not a plain relative path (printable names joined by '/', none of them empty, '.' or "
                    "'..'); every listed file must lie inside the directory")
        if not isinstance(entry, dict):
            return f"{where}: expected {ENTRY}, got {_got(entry)}"
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return f'{where}["size"]: expected a number of bytes, got {_got(size)}'
        if not isinstance(entry.get("hash"), str):
            return f'{where}["hash"]: expected a digest (a string), got {_got(entry.get("hash"))}'
    return None


def verify(root: Path, files: Dict[str, Dict[str, object]], listing: str = LISTING) -> Optional[str]:
    """None when every listed file is there with its size and hash; else the first problem, naming the file. The
    list's shape is checked first (`shape_problem`), and a file whose real path is outside `root` (a link leading
    out) or that is not a regular file is a problem, never read."""
    shape = shape_problem(files, listing)
    if shape is not None:
        return shape
    root = Path(os.path.realpath(root))
    for rel, want in sorted(files.items()):
        path = Path(os.path.realpath(root / rel))  # not Path.resolve: it raises RuntimeError on a link loop
        if not path.is_relative_to(root):
            return f"{rel}: a link leading outside the directory; every listed file must lie inside it"
        try:
            info = path.stat()
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return f"{rel}: missing"
            return f"{rel}: unreadable ({exc.strerror or exc})"
        if not stat.S_ISREG(info.st_mode):
            return f"{rel}: not a regular file"
        size = info.st_size
        if size != want["size"]:
            return f"{rel}: {size} bytes, {want['size']} when it was written (truncated or replaced)"
        try:
            digest = file_digest(path, size)
        except OSError as exc:
            return f"{rel}: unreadable ({exc.strerror or exc})"
        if digest != want["hash"]:
            return f"{rel}: content differs from when it was written"
    return None


def unlisted(root: Path, files: Dict[str, Dict[str, object]], ignore: Iterable[str] = (),
             listing: str = LISTING, what: str = "checkpoint") -> Optional[str]:
    """The first file below `root` that `files` does not list (`ignore`: top-level names left out, e.g. the record
    itself): a file added after the commit, which a loader globbing for shards would read unverified. A list of
    another shape is the problem instead (`shape_problem`)."""
    shape = shape_problem(files, listing)
    if shape is not None:
        return shape
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
                return f"{rel}: not part of the {what} as it was written (added later)"
    return None
