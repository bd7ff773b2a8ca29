"""Has a local data file changed since it was indexed or verified? (issue 43, item 2)

The launching process records each file's size and modification time with its index (data=iterable) or the ranks
verify a part by its hash (data=presharded); a file rewritten, truncated or replaced while the run reads it must be
one DataError naming the file and what changed, at the first read that sees it - never an IndexError from a block
that holds fewer lines than indexed, and never a silent read of the new bytes. Checks are one fstat (and one stat of
the path, for a file replaced by another) per read: cheap next to the read itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

from dsrecipes.core.errors import DataError

T = TypeVar("T")


@dataclass(frozen=True)
class Seen:
    """A file as it was when indexed: size and modification time (`mtime_ns` None: not compared, e.g. a converted
    copy checked by content), and the inode read (None: not known yet)."""

    size: int
    mtime_ns: Optional[int]
    inode: Optional[int] = None


def differences(seen: Seen, st: os.stat_result) -> List[str]:
    """What differs between `seen` and `st`, in words (empty: nothing)."""
    out = []
    if st.st_size != seen.size:
        out.append(f"size {seen.size} -> {st.st_size} bytes")
    if seen.mtime_ns is not None and st.st_mtime_ns != seen.mtime_ns:
        out.append("modification time changed")
    if seen.inode is not None and st.st_ino != seen.inode:
        out.append("replaced by another file")
    return out


def changed(name: str, what: List[str], since: str = "the launching process indexed it") -> DataError:
    return DataError(f"{name}: changed since {since} ({'; '.join(what)}); the run cannot go on reading it. Put the "
                     "original back and resume, or start a new run over the new data")


def check_fd(name: str, seen: Seen, fd: int, path: str, since: str = "the launching process indexed it") -> None:
    """Raise `changed` when the open file `fd` (or what is now at `path`) is not the file `seen`."""
    what = differences(seen, os.fstat(fd))
    if not what:
        try:
            now = os.stat(path)
        except OSError:
            what = ["removed"]
        else:
            if now.st_ino != os.fstat(fd).st_ino or now.st_dev != os.fstat(fd).st_dev:
                what = ["replaced by another file"]
    if what:
        raise changed(name, what, since)


def check_read(name: str, got: int, wanted: int, start: int) -> None:
    """A read of `wanted` bytes at `start` that returned `got` (the file shrank under the reader)."""
    if got != wanted:
        raise changed(name, [f"{wanted} bytes expected at offset {start}, {got} read"])


def check_lines(name: str, block: int, got: int, wanted: int) -> None:
    """A block that holds fewer sample lines than the index counted."""
    if got < wanted:
        raise changed(name, [f"block {block} holds {got} sample lines, {wanted} indexed"])


def seen_now(paths: Sequence[str]) -> List[Tuple[str, Seen]]:
    """Local files as they are now (URLs and missing files left out: checked elsewhere)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.append((path, Seen(st.st_size, st.st_mtime_ns, st.st_ino)))
    return out


def watched(items: Iterable[T], files: Sequence[Tuple[str, Seen]], since: str) -> Iterator[T]:
    """`items`, each checked after it was read: its file is still the one `files` recorded (a stat per item)."""
    for item in items:
        for path, seen in files:
            try:
                what = differences(seen, os.stat(path))
            except OSError:
                what = ["removed"]
            if what:
                raise changed(path, what, since)
        yield item
