"""Checking a checkpoint again in the process that unpickles it, right before each file is loaded (issue 50 item 3).

The launching process verifies a checkpoint (checkpoint_find.py) and names it in plan.json; seconds later each rank
unpickles its files (DeepSpeed's `engine.load_checkpoint` with weights_only=False). Whoever could replace a file in
between used to run code in the rank. So the rank checks again, at the point of use:

- `CheckedCheckpoint.open` opens the tag directory once and keeps that descriptor: every later read goes through it
  (component by component, never following a link), so renaming another directory into its place changes nothing.
  It reads complete.json once through it; the record must carry this user's signature, or (a checkpoint trusted with
  --trust-checkpoint) be the very record the launching process accepted (`pinned`: the SHA-256 of its bytes, in
  plan.json) or be trusted on this process's command line; the latter two are loaded in `screened` mode.
- `load(path)` opens the listed file, checks size and hash (manifest.py) on that open descriptor, in screened mode
  checks what its pickle would import (safe_load.unsafe_globals, static) on the same descriptor, and hands torch the
  same open file (`/proc/self/fd/N`, which keeps torch's memory mapping; the file object itself where /proc is
  missing). A file replaced after the check is a different inode: the one loaded is the one checked.
- `guard()` routes every `torch.load` made while DeepSpeed loads (engine, universal checkpoint, zero_to_fp32)
  through `load`; a path no record lists is refused, as is any file-like object.

What remains (documented, not closed here): a write into the same inode after the check (it needs write permission
on the file itself, which a checkpoint's files, 0644 under the usual umask, give only to their owner); and the
manifest's own limit: a file over 4 MiB is identified by its size and three 1 MiB windows, so bytes outside them are
not compared (torch's pickle lies in the first window of a torch.save file, its zip directory in the last).
"""

from __future__ import annotations

import hashlib
import os
import stat
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import dsrecipes.boundary.trust as trust
import dsrecipes.core.manifest as manifest
from dsrecipes.boundary.safe_load import beyond_allowed
from dsrecipes.core.checkpoint_names import COMPLETE
from dsrecipes.core.errors import Refused
from dsrecipes.core.fileio import MAX_JSON_BYTES, Unreadable, loads_bounded
from dsrecipes.core.locks import try_shared

_NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECTORY = _NOFOLLOW | os.O_DIRECTORY


class ChangedCheckpoint(Refused):
    """A checkpoint file that differs, at the moment it is loaded, from what its signed record lists: exit 2."""


def record_digest(data: bytes) -> str:
    """What plan.json pins of a checkpoint's complete.json: the SHA-256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


def read_pinned(tag_dir: Path) -> str:
    """The digest of complete.json as it is now (the launching process pins it right after checking it)."""
    return record_digest((Path(tag_dir) / COMPLETE).read_bytes())


@dataclass
class _Listing:
    root: Path  # the directory as named (absolute)
    fd: int  # the directory, opened once
    files: Dict[str, Dict[str, Any]]
    screened: bool  # not signed by this user: every pickle is screened before it is loaded
    record: Dict[str, Any]  # complete.json as read through `fd`
    record_fd: int = -1  # complete.json, open with a shared lock while the checkpoint is read (locks.try_shared)


def _open_below(dir_fd: int, rel: str, flags: int = _NOFOLLOW) -> int:
    """`rel` (a plain relative path) opened below the directory `dir_fd`, no component followed as a link."""
    parts = rel.split("/")
    fd = dir_fd
    try:
        for name in parts[:-1]:
            nxt = os.open(name, _DIRECTORY, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


@contextmanager
def reading(tag_dir: Path) -> Iterator[None]:
    """A shared lock on the checkpoint's complete.json while the block reads it (checks included), so the
    retention of a run still writing it leaves it alone (rank/checkpoint.prune_checkpoints); ChangedCheckpoint
    when a retention pass has removed it or is removing it. A missing or odd record: no lock (the check names it)."""
    try:
        fd = os.open(Path(tag_dir) / COMPLETE, _NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        yield
        return
    try:
        _hold(fd, Path(os.path.abspath(tag_dir)))
        yield
    finally:
        os.close(fd)


def _hold(fd: int, root: Path) -> None:
    """A shared lock on the checkpoint's open complete.json `fd`, or ChangedCheckpoint: a retention pass holds it
    exclusively, or has removed it (no link left)."""
    if not try_shared(fd) or os.fstat(fd).st_nlink == 0:
        raise ChangedCheckpoint(_removed(root))


def _removed(root: Path) -> str:
    return (f"{root}: removed while it was being opened to load: the run writing {root.parent.parent} is still "
            "going and keeps only its newest trainer.keep_checkpoints checkpoints; nothing was loaded. Take a newer "
            "checkpoint (`dsrecipes export` without --tag takes the newest) or wait for that run to end")


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _read_all(fd: int, limit: Optional[int] = None) -> bytes:
    """What is left to read from `fd`, or its first `limit` bytes."""
    chunks, size = [], 0
    while limit is None or size < limit:
        block = os.read(fd, 1 << 20 if limit is None else min(1 << 20, limit - size))
        if not block:
            break
        chunks.append(block)
        size += len(block)
    return b"".join(chunks)


@dataclass
class CheckedCheckpoint:
    """The files of one checkpoint (plus its universal conversion, when added) as their signed records list them."""

    listings: List[_Listing] = field(default_factory=list)
    passthrough: List[Path] = field(default_factory=list)  # written by this process during the load (conversion)

    @classmethod
    def open(cls, tag_dir: Path, pinned: Optional[str] = None) -> "CheckedCheckpoint":
        checked = cls()
        checked.add(Path(tag_dir), pinned)
        return checked

    def add(self, root: Path, pinned: Optional[str] = None) -> None:
        """Open `root`, read its complete.json once and accept it (see the module docstring); ChangedCheckpoint
        naming the file otherwise."""
        root = Path(os.path.abspath(root))
        try:
            fd = os.open(root, _DIRECTORY)
        except OSError as exc:
            raise ChangedCheckpoint(f"{root}: cannot open the checkpoint to load it ({exc.strerror or exc}); it "
                                    "was there when the run was planned. Nothing was loaded")
        record_fd = -1
        try:
            data, record_fd = self._record_bytes(root, fd)
            record = loads_bounded(data, "JSON nested too deeply")  # json's RecursionError: a traceback per rank
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            screened = self._accept(root, record, data, pinned)
        except (OSError, ValueError) as exc:
            _close(fd, record_fd)
            raise ChangedCheckpoint(f"{root / COMPLETE}: unreadable when loading ({exc}); nothing was loaded")
        except ChangedCheckpoint:
            _close(fd, record_fd)
            raise
        files = record.get("files")
        problem = manifest.shape_problem(files, f"{COMPLETE}: files")
        if problem is not None:
            _close(fd, record_fd)
            raise ChangedCheckpoint(f"{root}: {problem}; nothing was loaded")
        self.listings.append(_Listing(root, fd, files, screened, record, record_fd))

    @staticmethod
    def _record_bytes(root: Path, dir_fd: int) -> tuple:
        """(complete.json's bytes, its descriptor, holding a shared lock until `close`: a run's retention leaves the
        checkpoint alone meanwhile, rank/checkpoint.prune_checkpoints), within fileio's bounds: a FIFO put in its
        place is opened at once and refused (the rank never waits for a writer), a file over MAX_JSON_BYTES is
        never read whole (Unreadable either way)."""
        fd = _open_below(dir_fd, COMPLETE, _NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise Unreadable("not a regular file")  # as core/fileio.read_json_file says it
            _hold(fd, root)
            data = _read_all(fd, MAX_JSON_BYTES + 1)
            if len(data) > MAX_JSON_BYTES:
                raise Unreadable(f"larger than {MAX_JSON_BYTES} bytes")
            return data, fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _accept(root: Path, record: Dict[str, Any], data: bytes, pinned: Optional[str]) -> bool:
        """False (not screened) for a record signed by this user; True for one trusted by the launching process
        (pinned) or this command line; else ChangedCheckpoint."""
        if pinned is not None and record_digest(data) != pinned:
            raise ChangedCheckpoint(f"{root / COMPLETE}: changed since the launching process checked it (another "
                                    "record was put in its place); nothing was loaded")
        problem = trust.signature_problem(record)
        if problem is None:
            return False
        if pinned is not None or trust.is_trusted(root):
            return True
        raise ChangedCheckpoint(f"{root / COMPLETE}: {problem}, and it was not the record checked before this "
                                "load; nothing was loaded")

    @property
    def record(self) -> Dict[str, Any]:
        """The first directory's complete.json, as read and accepted by `open`."""
        return self.listings[0].record

    def allow_written(self, directory: Path) -> None:
        """Files below `directory` are written and read back by this process itself (a universal conversion's
        temporary slices): `load` passes them to torch unchanged."""
        self.passthrough.append(Path(os.path.abspath(directory)))

    def close(self) -> None:
        """Close the directories (the records stay readable; nothing more can be loaded through them)."""
        for listing in self.listings:
            _close(listing.fd, listing.record_fd)
            listing.fd, listing.record_fd, listing.files = -1, -1, {}

    def _find(self, path: Path) -> tuple:
        path = Path(os.path.abspath(path))
        for listing in sorted(self.listings, key=lambda item: len(item.root.parts), reverse=True):
            if path.is_relative_to(listing.root):
                rel = path.relative_to(listing.root).as_posix()
                if rel in listing.files:
                    return listing, rel
                break
        raise ChangedCheckpoint(f"{path}: not part of the checkpoint as it was written (its signed {COMPLETE} does "
                                "not list it); refusing to load it")

    def open_file(self, path: Path) -> tuple:
        """(fd, listing) of `path` open for reading, after its size and hash matched its record on that fd."""
        listing, rel = self._find(path)
        want = listing.files[rel]
        try:
            fd = _open_below(listing.fd, rel)
        except OSError as exc:
            raise ChangedCheckpoint(f"{path}: cannot open it to load ({exc.strerror or exc}); nothing was loaded")
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "not a regular file"
        elif info.st_size != want["size"]:
            problem = f"{info.st_size} bytes, {want['size']} when it was written (replaced)"
        elif manifest.fd_digest(fd, info.st_size) != want["hash"]:
            problem = "content differs from when it was written (replaced)"
        if problem is not None:
            os.close(fd)
            raise ChangedCheckpoint(f"{path}: {problem}, checked right before loading it; the checkpoint changed "
                                    "after the run was planned. Nothing of it was loaded")
        return fd, listing

    def read_bytes(self, path: Path) -> bytes:
        """The content of a listed file, checked (JSON records: data positions)."""
        fd, _ = self.open_file(path)
        try:
            return _read_all(fd)
        finally:
            os.close(fd)

    def load(self, path: Any, **kwargs: Any) -> Any:
        """torch.load of a listed file, from the very descriptor its hash was checked on."""
        import torch  # lazy: the launching process imports this module and never loads a checkpoint

        fd, listing = self.open_file(Path(path))
        try:
            if listing.screened:
                names = _unsafe_globals(fd)
                if names:
                    raise ChangedCheckpoint(f"{path}: refusing to load it: its pickle imports {', '.join(names[:5])}"
                                            ", which a checkpoint written by dsrecipes never holds")
            with os.fdopen(os.dup(fd), "rb") as fh:
                if kwargs.get("mmap") and not zipfile.is_zipfile(fh):
                    kwargs["mmap"] = False  # a legacy (pre-zip) file cannot be mapped
                proc = f"/proc/self/fd/{fd}"  # the same open file: a path torch can map
                if os.path.exists(proc):
                    return _ORIGINAL_LOAD.get("load", torch.load)(proc, **kwargs)
                kwargs.pop("mmap", None)
                fh.seek(0)
                return _ORIGINAL_LOAD.get("load", torch.load)(fh, **kwargs)
        finally:
            os.close(fd)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Every `torch.load` in this process goes through `load` until the block ends."""
        import torch  # lazy: the launching process imports this module and never loads a checkpoint

        original = torch.load

        def checked_load(f: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(f, (str, os.PathLike)):
                raise ChangedCheckpoint("refusing to unpickle a stream while loading a checkpoint: every file "
                                        "loaded must be one its signed record lists")
            where = Path(os.path.abspath(f))
            if any(where.is_relative_to(d) for d in self.passthrough):
                return original(f, *args, **kwargs)
            if args:
                kwargs["map_location"] = args[0]
            return self.load(where, **kwargs)

        _ORIGINAL_LOAD["load"] = original
        torch.load = checked_load
        try:
            yield
        finally:
            torch.load = original
            _ORIGINAL_LOAD.pop("load", None)


_ORIGINAL_LOAD: Dict[str, Any] = {}  # torch.load itself while `guard` has replaced it


def _unsafe_globals(fd: int) -> List[str]:
    import torch  # lazy: the launching process imports this module and never loads a checkpoint

    try:
        with os.fdopen(os.dup(fd), "rb") as fh:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(fh)
    except Exception as exc:  # noqa: BLE001 - a pickle the static reader cannot follow is not loaded
        raise ChangedCheckpoint(f"not a torch.save file that can be checked ({type(exc).__name__}); refusing to "
                                "load it")
    return beyond_allowed(found)
