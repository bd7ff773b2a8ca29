"""One stream file, indexed once: the byte offset of every block of lines.

A reader of `data=iterable` reads only the blocks that hold its samples, so it needs, per file, where each block
starts. The launching process finds every line boundary of every file once (numpy over 1 MiB chunks, in the same
pass that computes the file's content hash for `data/prepare/cache.py`), cuts the sample lines into blocks (one per
`block_bytes`-aligned stretch of the file that a sample line starts in, so a block is < block_bytes + one line), and
caches the result under `<cache>/stream/` by content hash and block size.

Files that cannot be read at an offset (gzip, JSON arrays) are converted once into a cached JSONL
(`<cache>/stream/<hash>.jsonl`, stream/convert.py); for a JSON array line L of the copy is element L-1 (`loc_base =
-1`: sample ids keep the original `<file>:<element>`, exactly as `data=map` names them; messages say
`<file>: element N (line L)`). A file without rows gets `problem` and no samples, and the bad-row policy decides
(like `data=map`, which counts it as one bad row); a file that breaks (corrupt gzip, broken JSON structure) is
refused under both policies (`files.FileUnreadable`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from dsrecipes.core.fileio import atomic_write_json, atomic_writer, loads_bounded, read_json_file
from dsrecipes.data.prepare.cache import cache_root, content_hashes
from dsrecipes.data.sources.remote import is_url, open_bytes, pin, size_mtime, store_errors
from dsrecipes.data.stream.convert import CHUNK, convert, file_kind

INDEX_VERSION = 1
_WS = np.zeros(256, dtype=bool)
_WS[list(b" \t\n\r\x0b\x0c")] = True  # bytes.isspace(): a line of only these is blank, not a sample


@dataclass
class FileIndex:
    """Where the samples of one file are. `offsets[b]`: byte where block b's first sample line starts in `path`;
    `lines[b]`: its 1-based line number; `firsts[b]`: its sample number in the file."""

    name: str  # the file as the user named it (messages, sample ids)
    path: str  # the file read: `name`, or its converted copy
    loc_base: int  # sample location = line + loc_base (0: JSONL lines; -1: JSON array elements)
    size: int  # of `path`, checked by the ranks
    mtime_ns: int
    digest: str  # content hash of `name`
    count: int  # sample lines
    offsets: np.ndarray = field(repr=False)
    lines: np.ndarray = field(repr=False)
    firsts: np.ndarray = field(repr=False)
    problem: Optional[Tuple[str, str]] = None  # (BadReason value, detail): the file as a whole is unusable
    etag: str = ""  # an object in a store: the ETag/VersionId every ranged read must match (remote.pin)

    def block_of(self, sample: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.firsts, sample, side="right") - 1


class LineScanner:
    """Fed a file's bytes in order; finds the sample lines (not blank) and cuts them into blocks: a block starts at
    the first sample line that starts in each `block_bytes`-aligned stretch of the file, so a block holds less than
    `block_bytes` plus one line. Vectorised: only lines that begin with whitespace are looked at one by one."""

    def __init__(self, block_bytes: int):
        self.block_bytes = max(1, int(block_bytes))
        self.pos = 0  # bytes fed
        self.line_no = 0  # lines completed
        self.line_start = 0  # where the current (unfinished) line starts
        self.partial_nonws = False  # the unfinished line has a non-blank byte
        self.samples = 0
        self.last_cell = -1
        self.blocks: List[np.ndarray] = []  # rows of (offset, line, first sample)

    def feed(self, chunk: bytes) -> None:
        a = np.frombuffer(chunk, dtype=np.uint8)
        nl = np.flatnonzero(a == 10)
        if nl.size == 0:
            self.partial_nonws = self.partial_nonws or bool(chunk.strip())
            self.pos += a.size
            return
        seg = np.concatenate(([0], nl[:-1] + 1))  # where each line ending in this chunk starts (in the chunk)
        sample = ~_WS[a[seg]] & (nl > seg)
        sample[0] = self.partial_nonws or bool(chunk[: nl[0]].strip())
        for i in np.flatnonzero(~sample[1:]) + 1:  # begins with whitespace: blank only if all of it is
            sample[i] = bool(chunk[seg[i]:nl[i]].strip())
        starts = self.pos + seg
        starts[0] = self.line_start
        self._add(starts[sample], self.line_no + 1 + np.flatnonzero(sample))
        self.line_no += nl.size
        self.line_start = self.pos + int(nl[-1]) + 1
        self.partial_nonws = bool(chunk[nl[-1] + 1:].strip())
        self.pos += a.size

    def _add(self, starts: np.ndarray, lines: np.ndarray) -> None:
        cells = starts // self.block_bytes
        new = np.flatnonzero(np.diff(np.concatenate(([self.last_cell], cells))) > 0)
        if new.size:
            self.blocks.append(np.stack((starts[new], lines[new], self.samples + new), axis=1))
            self.last_cell = int(cells[-1])
        self.samples += starts.size

    def finish(self) -> Tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(sample count, offsets, lines, firsts) once the whole file was fed."""
        if self.partial_nonws:  # a last line without a newline
            self._add(np.array([self.line_start]), np.array([self.line_no + 1]))
        arr = np.concatenate(self.blocks) if self.blocks else np.zeros((0, 3), dtype=np.int64)
        return self.samples, arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy()


# ---------------------------------------------------------------------------------------------------------------
# Index files (cached by content hash)


def index_files(cfg: Any, names: List[str], block_bytes: int,
                tap: Optional[Callable[[str], Optional[Callable[[bytes], None]]]] = None) -> List[FileIndex]:
    """The FileIndex of each file, from the cache or built (one pass for hash + index of a plain JSONL file).
    `tap(name)` may give a feed that sees the bytes of a JSONL file read in place, in the same pass (the row
    pre-scan, stream/scan_files.py)."""

    root = cache_root(cfg) / "stream"
    scanners: Dict[str, LineScanner] = {}

    def hook(name: str) -> Optional[Callable[[bytes], None]]:
        if file_kind(name) != "jsonl":
            return None
        scanners[name] = LineScanner(block_bytes)
        extra = tap(name) if tap is not None else None
        if extra is None:
            return scanners[name].feed
        return lambda block: (scanners[name].feed(block), extra(block)) and None

    digests = content_hashes(cfg, names, hook)
    return [_index_one(name, digest, block_bytes, root, scanners.get(name), tap=tap)
            for name, digest in zip(names, digests)]


def _index_one(name: str, digest: str, block_bytes: int, root: Path, scanner: Optional[LineScanner],
               tap: Optional[Callable[[str], Optional[Callable[[bytes], None]]]] = None) -> FileIndex:
    cached = root / f"{digest}-b{block_bytes}-v{INDEX_VERSION}.npz"
    fi = _load(cached, name, digest)
    if fi is not None:
        return fi
    problem: Optional[Tuple[str, str]] = None
    read_path, loc_base = name, 0
    if file_kind(name) != "jsonl":
        read_path, loc_base, scanner, problem = _converted(name, root / f"{digest}.jsonl", block_bytes)
    size, mtime_ns = size_mtime(read_path)
    if problem is None and (scanner is None or scanner.pos != size):
        feed = tap(name) if tap is not None and read_path == name else None
        scanner = _scan(read_path, block_bytes, feed)  # not fed while hashing (memo hit, an object), JSON lines
    count, offsets, lines, firsts = scanner.finish() if scanner is not None else (0, *(np.zeros(0, np.int64),) * 3)
    if problem is None and count == 0:
        problem = ("empty_file", "no rows")
    etag = pin(read_path, digest) if is_url(read_path) else ""  # the version the reads are pinned to
    fi = FileIndex(name, read_path, loc_base, size, mtime_ns, digest, count, offsets, lines, firsts, problem, etag)
    _save(cached, fi)
    return fi


def _converted(name: str, out: Path, block_bytes: int) -> Tuple[str, int, Any, Optional[Tuple[str, str]]]:
    """(read path, loc_base, scanner or None, problem) of a file needing conversion. A copy already in the cache
    (content-addressed, written atomically, described by `<hash>.convert.json`) is reused as it is: converting again
    would change its modification time under runs that read it."""
    meta_path = out.with_suffix(".convert.json")
    try:
        meta = read_json_file(meta_path, "nested too deeply")  # bounded: the cache may be shared
    except (OSError, ValueError):  # missing, damaged, a FIFO, too large, too deep: converted again
        meta = None
    if meta is not None and meta["problem"] is None and (meta["path"] == name or out.is_file()):
        problem = tuple(meta["problem"]) if meta["problem"] else None
        return name if meta["path"] == name else str(out), meta["loc_base"], None, problem
    read_path, loc_base, scanner, problem = convert(name, out, lambda: LineScanner(block_bytes))  # FileUnreadable

    path = name if read_path == name else "converted"
    atomic_write_json(meta_path, {"path": path, "loc_base": loc_base, "problem": problem})
    return read_path, loc_base, scanner, problem


def _scan(path: str, block_bytes: int, tap: Optional[Callable[[bytes], None]] = None) -> LineScanner:
    scanner = LineScanner(block_bytes)
    # the reads too, not only the open: a store that fails for good mid-object is one message naming it
    with store_errors(path) if is_url(path) else contextlib.nullcontext(), open_bytes(path) as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            scanner.feed(block)
            if tap is not None:
                tap(block)
    return scanner


def _save(path: Path, fi: FileIndex) -> None:
    meta = {"path": fi.path, "loc_base": fi.loc_base, "size": fi.size, "mtime_ns": fi.mtime_ns, "count": fi.count,
            "problem": fi.problem, "converted": fi.path != fi.name, "etag": fi.etag}
    try:
        with atomic_writer(path) as fh:
            np.savez(fh, offsets=fi.offsets, lines=fi.lines, firsts=fi.firsts, meta=np.array(json.dumps(meta)))
    except OSError:
        pass  # a read-only cache only costs indexing again next time


def _load(path: Path, name: str, digest: str) -> Optional[FileIndex]:
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = loads_bounded(str(z["meta"]), "nested too deeply")  # too deep: indexed again
            arrays = z["offsets"], z["lines"], z["firsts"]
    except (OSError, ValueError, KeyError):
        return None
    read_path = meta["path"] if meta["converted"] else name
    try:
        size, mtime_ns = (meta["size"], meta["mtime_ns"]) if is_url(read_path) else size_mtime(read_path)
    except OSError:
        return None  # the converted copy was removed: convert again
    if size != meta["size"]:
        return None
    problem = tuple(meta["problem"]) if meta["problem"] else None
    return FileIndex(name, read_path, meta["loc_base"], size, mtime_ns, digest, meta["count"], *arrays, problem,
                     meta.get("etag", ""))
