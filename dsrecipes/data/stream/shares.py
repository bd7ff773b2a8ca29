"""`dataset.split` under `data=iterable`: which lines of the stream are the run's share, and the caps, decided by
the launching process while it indexes (stream/index.py `index_stream`).

A line's share is the map reader's: the line parsed as every reader parses it (`files.parse_row`), its row id and
share by data/sources/split_shares.py (`keeps`: a pinned source is whole in its share, read without parsing). The
other shares' lines become `StreamIndex.outside` (natural numbers), which leave the training order exactly as held-out
rows do (block counts, block reads), so the run plan's rows, equal steps and exact and elastic resume are the index's
as without a split; the validation hold-out (`dataset.val_size`) is drawn among the share's lines (`share_numbers`).
Caps (`sources[i].max_samples`, then `dataset.max_samples`) count the share's lines (data=map counts the share's
rows), and are applied here with or without a split. Validation files (`dataset.val_paths`) are not split. Which
lines of a file are in the share is cached by the file's content hash (`<data.cache_dir>/stream/*-share-*.npy`), so
only a run's first launch reads the corpus for it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.core.fileio import atomic_writer
from dsrecipes.data.prepare.cache import cache_root
from dsrecipes.data.sources.files import parse_row
from dsrecipes.data.sources.split_shares import keeps


def take_share(index: Any, sources: Sequence[Any], cfg: Any, open_source: Callable[[], Any]
               ) -> Tuple[List[int], np.ndarray]:
    """(caps: sample lines of each file that belong to the stream, outside: natural numbers of the lines of other
    shares within the caps) of a freshly indexed stream. `open_source()`: a BlockSource over `index`."""
    dataset = cfg.dataset
    kept = _kept_lines(index, sources, dataset.max_row_bytes, open_source, cache_root(cfg) / "stream")
    counts = [fi.count if k is None else int(k.sum()) for fi, k in zip(index.files, kept)]
    share_caps = caps_of(counts, index.file_source, [s.max_samples for s in sources], dataset.max_samples)
    caps, outside, base = [], [], 0
    for f, (fi, k) in enumerate(zip(index.files, kept)):
        if k is None or share_caps[f] < counts[f]:  # the line of the first share row past the cap
            caps.append(share_caps[f] if k is None else int(np.flatnonzero(k)[share_caps[f]]))
        else:
            caps.append(fi.count)
        if index.file_source[f] >= 0:
            if k is not None:
                outside.append(base + np.flatnonzero(~k[:caps[f]]))
            base += caps[f]
    return caps, np.concatenate(outside).astype(np.int64) if outside else np.zeros(0, np.int64)


def _kept_lines(index: Any, sources: Sequence[Any], limit: int, open_source: Callable[[], Any], root: Path
                ) -> List[Optional[np.ndarray]]:
    """Per file: None (no split, a validation file), else whether each sample line is in the share (a source pinned
    to a share: all or none, unread)."""
    kept: List[Optional[np.ndarray]] = [None] * len(index.files)
    source = None
    try:
        for f, s in enumerate(index.file_source):
            src, fi = (sources[s], index.files[f]) if s >= 0 else (None, None)
            if src is None or src.share is None:
                continue
            if src.share.pinned is not None:
                kept[f] = np.full(fi.count, src.share.pinned == src.share.take)
                continue
            path = root / f"{fi.digest}-share-{_key(src.share, limit)}.npy"
            kept[f] = _load(path, fi.count)
            if kept[f] is None:
                source = open_source() if source is None else source
                kept[f] = np.fromiter((keeps(row, src) for row in rows_of(source, f, limit)), bool, fi.count)
                _save(path, kept[f])
    finally:
        if source is not None:
            source.close()
    return kept


def _key(share: Any, limit: int) -> str:
    material = {"version": 1, "shares": sorted(share.shares.items()), "take": share.take, "limit": limit}
    return hashlib.blake2b(json.dumps(material).encode(), digest_size=10).hexdigest()


def _load(path: Path, count: int) -> Optional[np.ndarray]:
    try:
        kept = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    return kept if kept.dtype == np.bool_ and kept.shape == (count,) else None


def _save(path: Path, kept: np.ndarray) -> None:
    try:
        with atomic_writer(path) as fh:
            np.save(fh, kept, allow_pickle=False)
    except OSError:
        pass  # a read-only cache only costs reading the files again next time


def rows_of(source: Any, f: int, limit: int) -> Any:
    """Every sample line of file f as a RawRow, parsed as the readers parse it (sharegpt.parse_item)."""
    fi = source.index.files[f]
    element = fi.loc_base < 0
    for local in range(fi.offsets.size):
        end = int(fi.firsts[local + 1]) if local + 1 < fi.offsets.size else fi.count
        for loc, raw in source.samples(f, local, end - int(fi.firsts[local])):
            raw = None if raw is not None and len(raw) > limit else raw
            yield parse_row(fi.name, None if element else loc, raw, loc if element else None, limit=limit)


def share_numbers(ranks: np.ndarray, outside: np.ndarray) -> np.ndarray:
    """Natural numbers of the share's lines of ranks `ranks` (the k-th line not `outside`; both sorted)."""
    if not outside.size:
        return ranks
    return ranks + np.searchsorted(outside - np.arange(outside.size), ranks, "right")


def outside_of(index: Any, base: int, cap: int) -> frozenset:
    """Sample numbers (in their file) of the other shares' lines of the training file whose first natural number is
    `base` (the pre-scan leaves them to the runs of their shares)."""
    out = index.outside
    lo, hi = np.searchsorted(out, base), np.searchsorted(out, base + cap)
    return frozenset((out[lo:hi] - base).tolist())


def caps_of(counts: Sequence[int], file_source: Sequence[int], source_caps: Sequence[Optional[int]],
            total_cap: Optional[int]) -> List[int]:
    """Samples of each file after the caps: each source's first `max_samples`, then the dataset's first."""
    caps = list(counts)
    left = {s: c for s, c in enumerate(source_caps) if c is not None}
    for f, s in enumerate(file_source):
        if s in left:
            caps[f] = min(caps[f], left[s])
            left[s] -= caps[f]
    if total_cap is not None:
        for f, s in enumerate(file_source):
            if s >= 0:
                caps[f] = min(caps[f], total_cap)
                total_cap -= caps[f]
    return caps
