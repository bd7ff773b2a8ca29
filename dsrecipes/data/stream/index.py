"""The files of a `data=iterable` run as blocks: built once by the launching process, read by every reader.

`build_stream_index(cfg)` resolves the dataset's sources (`registry.resolve_sources` order, globs sorted), indexes
every file (stream/files.py, cached by content hash), applies the caps (`sources[i].max_samples`, then
`dataset.max_samples`: the first N lines in this natural order, blank lines are not samples) and picks the
validation rows: every row of `dataset.val_paths`, else `dataset.val_size` rows of the training files chosen by
`splits.split_val` (seeded by `trainer.seed`) over the natural sample numbers; held-out rows never enter the
training order, nor do the other shares' lines under `dataset.split` (stream/shares.py, which applies the caps). `write`/`read_stream_index` keep it in the run directory (`stream_index.json` + `.npz`), so ranks
never index anything; they check each file's size and modification time against it.

`BlockSource` reads blocks: one `pread` of the block's byte range (at most `block_bytes` plus one line), its sample
lines in file order, held-out rows dropped, counting the bytes it read. Blocks of objects in a store are read ahead
of the reader from its plan (`plan`, stream/reader.py), adjacent ones in one ranged GET (data/sources/remote_ahead.py);
the order keeps `chunk_bytes` of adjacent blocks together so that a reader has adjacent blocks (stream/sizes.py).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.core.errors import DataError
from dsrecipes.core.fileio import atomic_write_json, atomic_writer
from dsrecipes.core.schema import DEFAULT_MAX_ROW_BYTES, DEFAULT_READ_AHEAD_BYTES, DEFAULT_SPAN_BYTES, SourceConfig
from dsrecipes.data.sources.files import expand_paths, lines_in_range, no_file
from dsrecipes.data.sources.registry import registry_digest, resolve_sources, validation_files
from dsrecipes.data.sources.remote import ObjectChanged, is_url, size_mtime
from dsrecipes.data.sources.remote import identity as remote_identity
from dsrecipes.data.sources.remote_ahead import RangePool, ReadAhead
from dsrecipes.data.sources.splits import split_val
from dsrecipes.data.stream.changed import Seen, changed, check_fd, check_lines, check_read, differences
from dsrecipes.data.stream.files import FileIndex, index_files
from dsrecipes.data.stream.order import BlockTable, chunks_of
from dsrecipes.data.stream.shares import share_numbers, take_share
from dsrecipes.data.stream.sizes import auto_block_bytes, blocks_per_chunk, chunk_bytes_of

INDEX_FILE = "stream_index.json"
ARRAYS_FILE = "stream_index.npz"
STREAM_VERSION = 1


@dataclass
class StreamIndex:
    files: List[FileIndex]  # training files, then validation files (`dataset.val_paths`)
    caps: List[int]  # samples of each file that belong to the stream (training files: after max_samples)
    file_source: List[int]  # source of each training file; -1 for validation files
    sources: List[Tuple[str, float]]  # (name, weight)
    block_bytes: int
    holdout: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # natural numbers held out
    chunk_bytes: int = 0  # the order keeps chunk_bytes // block_bytes adjacent blocks together (stream/sizes.py)
    outside: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # other shares' (stream/shares.py)
    registry: Optional[str] = None  # sha256 of the dataset.registry read for it: a rank's read must find the same

    @property
    def dropped(self) -> np.ndarray:
        """Natural numbers out of the training order: held out for validation, or of another share."""
        return np.union1d(self.holdout, self.outside) if self.outside.size else self.holdout

    @property
    def blocks_per_chunk(self) -> int:
        return blocks_per_chunk(self.chunk_bytes, self.block_bytes)

    @property
    def train_files(self) -> List[int]:
        return [f for f, s in enumerate(self.file_source) if s >= 0]

    @property
    def val_files(self) -> List[int]:
        return [f for f, s in enumerate(self.file_source) if s < 0]

    @property
    def num_lines(self) -> int:
        """Training samples before the hold-out (lines of the training files after the caps)."""
        return sum(self.caps[f] for f in self.train_files)

    @cached_property
    def blocks(self) -> Dict[str, np.ndarray]:
        """Training blocks in natural order: file, block in file, natural number of the first sample, samples."""
        cols: Dict[str, List[np.ndarray]] = {"file": [], "local": [], "first": [], "count": []}
        base = 0
        for f in self.train_files:
            fi, cap = self.files[f], self.caps[f]
            nb = int(np.searchsorted(fi.firsts, cap, "left"))
            firsts = fi.firsts[:nb]
            counts = np.minimum(np.append(fi.firsts[1:nb], cap), cap) - firsts
            cols["file"].append(np.full(nb, f))
            cols["local"].append(np.arange(nb))
            cols["first"].append(base + firsts)
            cols["count"].append(counts)
            base += cap
        return {k: np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64) for k, v in cols.items()}

    def table(self) -> BlockTable:
        b = self.blocks
        out = self.dropped
        held = np.searchsorted(out, b["first"] + b["count"]) - np.searchsorted(out, b["first"])
        source = np.asarray(self.file_source, dtype=np.int64)[b["file"]] if b["file"].size else b["file"]
        chunk = chunks_of(b["file"], b["local"], self.blocks_per_chunk)
        return BlockTable(b["count"] - held, source, tuple(w for _, w in self.sources), chunk)

    @property
    def num_val(self) -> int:
        return sum(self.caps[f] for f in self.val_files) if self.val_files else int(self.holdout.size)

    def val_refs(self) -> List[Tuple[int, int]]:
        """(file, sample number in the file) of every validation row, in natural order."""
        if self.val_files:
            return [(f, i) for f in self.val_files for i in range(self.caps[f])]
        bases = np.cumsum([0] + [self.caps[f] for f in self.train_files])
        files = self.train_files
        return [(files[k], int(n - bases[k])) for n in self.holdout.tolist()
                for k in [int(np.searchsorted(bases, n, "right")) - 1]]

    def verify(self) -> None:
        """Every file still has the size and modification time it had when indexed (ranks, before reading)."""
        for fi in self.files:
            if is_url(fi.path):  # every ranged read is pinned by If-Match: no HEAD per rank and object
                if not fi.etag and remote_identity(fi.path) != fi.digest:
                    raise ObjectChanged(fi.path)
                continue
            try:
                what = differences(seen(fi), os.stat(fi.path))
            except OSError:
                raise DataError(f"{fi.path}: missing on this node (indexed by the launching process for {fi.name}); "
                                "data.cache_dir must be on storage every node sees") from None
            if what:
                raise changed(fi.name, what)


# ---------------------------------------------------------------------------------------------------------------
# Building (launching process, audit) and the run directory copy


def seen(fi: FileIndex) -> Seen:
    """The file as indexed (a converted copy is checked by content at indexing: its size only)."""
    return Seen(fi.size, fi.mtime_ns if fi.path == fi.name else None)


def build_stream_index(cfg: Any) -> StreamIndex:
    """The index of `cfg.dataset` with its validation rows held out (`index_stream` + `hold_out`)."""
    return hold_out(index_stream(cfg), cfg)


def hold_out(index: StreamIndex, cfg: Any) -> StreamIndex:
    """Hold out `dataset.val_size` rows of the training files, among the share's lines under `dataset.split` (none
    when `dataset.val_paths` names files)."""

    if not index.val_files and cfg.dataset.val_size > 0:
        pick = split_val(index.num_lines - index.outside.size, cfg.dataset.val_size, cfg.trainer.seed)
        index.holdout = share_numbers(np.asarray(pick, np.int64), index.outside)
    return index


def index_stream(cfg: Any, tap: Any = None) -> StreamIndex:
    """Every file of `cfg.dataset` (and `dataset.val_paths`) indexed, caps applied, nothing held out yet. `tap`:
    see `stream_files.index_files` (the row pre-scan in the indexing pass)."""

    names: List[str] = []
    file_source: List[int] = []
    sources = resolve_sources(cfg.dataset)
    for s, source in enumerate(sources):
        files, missing = expand_paths(source.paths, parquet=False)  # an index of byte offsets of lines
        if missing:
            raise DataError(f"dataset source {source.name!r}: {no_file(missing[0])}")
        names += files
        file_source += [s] * len(files)
    val_names, missing = expand_paths(list(cfg.dataset.val_paths), parquet=False)
    if missing:
        raise DataError(f"dataset.val_paths: {no_file(missing[0])}")
    notes: List[str] = []
    names += validation_files(names, val_names, notes)
    for note in notes:
        print(note, file=sys.stderr)
    file_source += [-1] * len(val_names)
    total, remote = sum(size_mtime(n)[0] for n in names), any(is_url(n) for n in names)
    block_bytes = cfg.data.block_bytes or auto_block_bytes(total, remote)
    chunk_bytes = chunk_bytes_of(cfg.data.chunk_bytes, total, block_bytes, remote)
    one_tap = None
    if tap is not None:
        srcs = dict(zip(names, _file_configs(cfg, sources, file_source)))
        one_tap = lambda name: tap(name, srcs[name])  # noqa: E731
    files = index_files(cfg, names, block_bytes, one_tap)
    _whole_file_problems(files, cfg.dataset.bad_rows.value)
    index = StreamIndex(files, [fi.count for fi in files], file_source, [(s.name, s.weight) for s in sources],
                        block_bytes, chunk_bytes=chunk_bytes, registry=registry_digest(cfg.dataset.registry))
    index.caps, index.outside = take_share(index, sources, cfg, lambda: BlockSource(index, cfg.dataset.max_row_bytes))
    return index


def file_sources(cfg: Any, index: StreamIndex) -> List[Any]:
    """The SourceConfig of each file of `index` (validation files: the dataset's format, columns and roles)."""

    return _file_configs(cfg, resolve_sources(cfg.dataset, registry_digest=index.registry), index.file_source)


def _file_configs(cfg: Any, sources: Sequence[Any], file_source: Sequence[int]) -> List[Any]:
    ds = cfg.dataset
    val = SourceConfig(name=f"{ds.name}-val", paths=list(ds.val_paths), format=ds.format, columns=ds.columns,
                       roles=dict(ds.roles))
    return [sources[s] if s >= 0 else val for s in file_source]


def _whole_file_problems(files: Sequence[FileIndex], policy: str) -> None:
    """A file unusable as a whole stops the run under `bad_rows=error` (the scan quarantines it under `skip`)."""
    for fi in files:
        if fi.problem is not None and policy == "error":
            reason, detail = fi.problem
            raise DataError(f"{fi.name}: {reason} ({detail}); set dataset.bad_rows=skip to quarantine bad rows")


def write_stream_index(run_dir: str | Path, index: StreamIndex) -> None:
    files = [{"name": fi.name, "path": fi.path, "loc_base": fi.loc_base, "size": fi.size, "mtime_ns": fi.mtime_ns,
              "digest": fi.digest, "count": fi.count, "problem": fi.problem, "blocks": int(fi.offsets.size),
              "etag": fi.etag}
             for fi in index.files]
    meta = {"version": STREAM_VERSION, "block_bytes": index.block_bytes, "chunk_bytes": index.chunk_bytes,
            "sources": index.sources, "file_source": index.file_source, "caps": index.caps, "files": files,
            "registry": index.registry}
    cat = {k: np.concatenate([getattr(fi, k) for fi in index.files]) if index.files else np.zeros(0, np.int64)
           for k in ("offsets", "lines", "firsts")}
    with atomic_writer(Path(run_dir) / ARRAYS_FILE) as fh:
        np.savez(fh, holdout=index.holdout, outside=index.outside, **cat)
    atomic_write_json(Path(run_dir) / INDEX_FILE, meta)


def read_stream_index(run_dir: str | Path) -> Optional[StreamIndex]:
    """The run's index, or None when the launching process wrote none (a run directory of another strategy)."""
    path = Path(run_dir) / INDEX_FILE
    if not path.is_file():
        return None
    meta = json.loads(path.read_text(encoding="utf-8"))
    if meta.get("version") != STREAM_VERSION:
        raise DataError(f"{path}: stream index version {meta.get('version')!r}; start the run again")
    with np.load(Path(run_dir) / ARRAYS_FILE, allow_pickle=False) as z:
        arrays = {k: z[k] for k in ("offsets", "lines", "firsts", "holdout", "outside") if k in z}
    files, at = [], 0
    for m in meta["files"]:
        sl = slice(at, at + m["blocks"])
        at += m["blocks"]
        files.append(FileIndex(m["name"], m["path"], m["loc_base"], m["size"], m["mtime_ns"], m["digest"], m["count"],
                               arrays["offsets"][sl], arrays["lines"][sl], arrays["firsts"][sl],
                               tuple(m["problem"]) if m["problem"] else None, m.get("etag", "")))
    return StreamIndex(files, meta["caps"], meta["file_source"], [tuple(s) for s in meta["sources"]],
                       meta["block_bytes"], arrays["holdout"], meta.get("chunk_bytes", 0),
                       arrays.get("outside", np.zeros(0, np.int64)), meta.get("registry"))


# ---------------------------------------------------------------------------------------------------------------
# Reading


class BlockSource:
    """Reads training blocks (by global block number) and single samples; counts bytes read. Open files are kept
    per process (a DataLoader worker opens its own after the fork). A line longer than `max_row_bytes` is never
    read whole: its raw bytes are None (a too_large bad row). Objects in a store: see `plan`."""

    def __init__(self, index: StreamIndex, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
                 read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES, span_bytes: int = DEFAULT_SPAN_BYTES):
        self.index = index
        self.max_row_bytes = max_row_bytes
        self.read_ahead_bytes, self.span_bytes = read_ahead_bytes, span_bytes
        self._direct = 0  # bytes read outside the read-ahead
        self._fds: Dict[int, int] = {}
        self._ranges = RangePool()  # objects in a store: ranged GETs (If-Match, retries), one reader per thread
        self._ahead: Optional[ReadAhead] = None
        self._ahead_done = [0, 0]  # bytes and GETs of closed read-aheads
        self._dropped: Optional[np.ndarray] = None  # index.dropped, once the first block is read

    def __getstate__(self) -> Dict[str, Any]:  # a worker opens its own files
        return {"index": self.index, "max_row_bytes": self.max_row_bytes, "read_ahead_bytes": self.read_ahead_bytes,
                "span_bytes": self.span_bytes}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @property
    def bytes_read(self) -> int:
        return self._direct + self._ahead_done[0] + (self._ahead.bytes if self._ahead is not None else 0)

    @property
    def gets(self) -> int:
        """Ranged GETs of the read-ahead (spans; each counted once whatever its retries)."""
        return self._ahead_done[1] + (self._ahead.gets if self._ahead is not None else 0)

    def plan(self, takes: Iterator[int]) -> None:
        """The blocks the reader will ask for, in order (lazy; stream/reader.py): those of objects in a store are read
        ahead, `read_ahead_bytes` at most, adjacent ones in one GET of up to `span_bytes`; local files are read when
        asked (a pread is not worth a thread). Replaces the plan before."""
        self._end_plan()
        tickets = ((g, *where) for g in takes for where in [self._extent(g)] if where is not None)
        self._ahead = ReadAhead(tickets, self._get, budget=self.read_ahead_bytes, span_bytes=self.span_bytes,
                                threads=self._ranges.threads)

    def _extent(self, g: int) -> Optional[Tuple[int, int, int]]:
        """(file, start, stop) of block g when it is read in one piece from a store, else None."""
        b = self.index.blocks
        f, local = b["file"].item(g), b["local"].item(g)
        if not is_url(self.index.files[f].path):
            return None
        start, stop = self._span(f, local)
        return (f, start, stop) if stop - start <= self.index.block_bytes + self.max_row_bytes else None

    def _span(self, f: int, local: int) -> Tuple[int, int]:
        fi = self.index.files[f]
        return fi.offsets.item(local), fi.offsets.item(local + 1) if local + 1 < fi.offsets.size else fi.size

    def _get(self, f: int, start: int, stop: int) -> bytes:
        fi = self.index.files[f]  # one ranged GET of exactly these bytes, pinned to the indexed ETag, retried
        return self._ranges.read(fi.path, fi.digest, fi.etag, start, stop)

    def _end_plan(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead_done[0] += self._ahead.bytes
            self._ahead_done[1] += self._ahead.gets
            self._ahead = None

    def _pread(self, f: int, start: int, stop: int) -> bytes:
        fi = self.index.files[f]
        if is_url(fi.path):
            data = self._get(f, start, stop)
            self._direct += len(data)
            return data
        if f not in self._fds:
            if len(self._fds) >= 64:
                os.close(self._fds.pop(next(iter(self._fds))))
            self._fds[f] = os.open(fi.path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there must not wait for a writer
            check_fd(fi.name, seen(fi), self._fds[f], fi.path)  # before the first read too (closed with the others)
        data = os.pread(self._fds[f], stop - start, start)
        check_fd(fi.name, seen(fi), self._fds[f], fi.path)  # after the read: these bytes are the indexed ones
        check_read(fi.name, len(data), stop - start, start)
        self._direct += len(data)
        return data

    def samples(self, f: int, local: int, count: int, data: Optional[bytes] = None
                ) -> List[Tuple[int, Optional[bytes]]]:
        """(location, raw line or None when too long) of the first `count` sample lines of block `local` of file
        `f` (`data`: the block's bytes, already read ahead)."""

        fi = self.index.files[f]
        start, stop = self._span(f, local)
        if data is not None:
            lines: Any = data.split(b"\n")
        elif stop - start > self.index.block_bytes + self.max_row_bytes:  # holds a line over the limit
            lines = lines_in_range(lambda a, b: self._pread(f, a, b), start, stop, self.max_row_bytes)
        else:
            lines = self._pread(f, start, stop).split(b"\n")
        out: List[Tuple[int, Optional[bytes]]] = []
        line = fi.lines.item(local)
        for raw in lines:
            if raw is None or raw.strip():
                out.append((line + fi.loc_base, raw))
                if len(out) == count:
                    break
            line += 1
        check_lines(fi.name, local, len(out), count)
        return out

    def block(self, g: int) -> List[Tuple[int, int, bytes]]:
        """(file, location, raw) of the kept samples of training block g, in file order."""
        data = self._ahead.take(g) if self._ahead is not None else None
        b = self.index.blocks
        f, first, count = b["file"].item(g), b["first"].item(g), b["count"].item(g)
        rows = self.samples(f, b["local"].item(g), count, data)
        held = self._dropped = self.index.dropped if self._dropped is None else self._dropped
        lo, hi = np.searchsorted(held, first), np.searchsorted(held, first + count)
        if lo == hi:
            return [(f, loc, raw) for loc, raw in rows]
        drop = set((held[lo:hi] - first).tolist())
        return [(f, loc, raw) for j, (loc, raw) in enumerate(rows) if j not in drop]

    def rows(self, refs: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, bytes]]:
        """(file, location, raw) of samples given as (file, sample number in the file), one read per block."""
        out: List[Tuple[int, int, bytes]] = []
        cache: Dict[Tuple[int, int], List[Tuple[int, bytes]]] = {}
        for f, n in refs:
            fi = self.index.files[f]
            local = int(fi.block_of(np.asarray(n)))
            if (f, local) not in cache:
                cache.clear()
                end = int(fi.firsts[local + 1]) if local + 1 < fi.firsts.size else fi.count
                cache[(f, local)] = self.samples(f, local, end - int(fi.firsts[local]))
            loc, raw = cache[(f, local)][n - int(fi.firsts[local])]
            out.append((f, loc, raw))
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._end_plan()
        self._ranges.close()
