"""The two ways a reader turns the plan into sample indices: an index list for map data, a stream filter for streams.

Both only call `plan.py`; nothing here knows about tokenizers or torch, so `dsrecipes audit` runs the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from dsrecipes.data.plan import EpochPlan, Layout, StreamShuffle, epoch_order, file_order
from dsrecipes.errors import DataError
from dsrecipes.fileio import open_maybe_gzip

T = TypeVar("T")


def map_micro_batches(plan: EpochPlan, rank: int, seed: int, epoch: int, shuffle: bool) -> List[List[int]]:
    """Row indices of each remaining micro-batch of `rank`, in order (the batch sampler of `data=map`).

    DataLoader workers receive these lists round-robin and only fetch; they never choose samples.
    """
    return map_rank_rows(plan, rank, epoch_order(plan.num_samples, seed, epoch, shuffle)).tolist()


def map_rank_rows(plan: EpochPlan, rank: int, order: np.ndarray, worker: Optional[int] = None) -> np.ndarray:
    """[micro-batches, micro_batch_size] row indices of `rank` (or of one of its DataLoader workers)."""
    positions = plan.rank_positions(rank, worker)
    return order[positions] if positions.size else positions


class StreamTooShort(Exception):
    """The stream ended before a position this reader was planned to read (`data.num_samples` too large)."""

    def __init__(self, num_items: int, needed: int):
        super().__init__(f"the stream has {num_items} samples but the plan needs {needed}")
        self.num_items = num_items
        self.needed = needed


def select_slots(
    items: Iterable[T],
    shuffle: StreamShuffle,
    layout: Layout,
    rank: int,
    worker: int,
    *,
    offset: int = 0,
    start_micro: int = 0,
    steps: Optional[int] = None,
) -> Iterator[Tuple[int, List[T]]]:
    """Stream filter of one reader: yields (micro, items of that micro-batch) for the slots of (rank, worker).

    Every reader walks the same item stream, computes each item's position with `shuffle` (window by window) and
    keeps only positions whose slot it owns, so readers never coordinate and never overlap. `steps` is the planned
    steps of the epoch when the length is known (`data.num_samples`, presharded counts); then reading stops after
    the reader's last slot, and a stream that ends early raises StreamTooShort. With `steps=None` (a step budget
    over a stream of unknown length) a slot is released only once the stream has reached the end of its optimizer
    step, so every rank agrees on the number of whole steps; the partial last global batch is the remainder.
    """
    world, mbs, accum, gbatch = layout.world_size, layout.micro_batch_size, layout.grad_accum, layout.global_batch
    readers = layout.readers_per_rank
    known_end = None if steps is None else offset + steps * gbatch
    last_micro: Optional[int] = None
    if steps is not None:
        mine = range(start_micro + worker, steps * accum, readers)
        if not mine:
            return
        last_micro = mine[-1]

    pending: Dict[int, List[Tuple[int, T]]] = {}
    buf: List[T] = []
    start, index = 0, 0
    window_end = shuffle.window_end(0)

    def assign(positions: np.ndarray) -> None:
        valid = positions >= offset
        if known_end is not None:
            valid &= positions < known_end
        slot = (positions - offset) // mbs
        micro = slot // world
        keep = valid & (slot % world == rank) & (micro >= start_micro) & ((micro - start_micro) % readers == worker)
        for i in np.flatnonzero(keep):
            pending.setdefault(int(micro[i]), []).append((int(positions[i]), buf[i]))

    def ready(micro: int, seen: int) -> bool:
        if known_end is not None:
            return offset + (micro * world + rank + 1) * mbs <= seen
        return offset + (micro // accum + 1) * gbatch <= seen

    def release(micro: int) -> List[T]:
        return [item for _, item in sorted(pending.pop(micro), key=lambda pair: pair[0])]

    for item in items:
        buf.append(item)
        if start + len(buf) < window_end:
            continue
        assign(shuffle.positions(index, start, len(buf)))
        start, index, buf = start + len(buf), index + 1, []
        window_end = shuffle.window_end(index)
        for micro in sorted(pending):
            if not ready(micro, start):
                break
            yield micro, release(micro)
            if micro == last_micro:
                return

    if buf:
        assign(shuffle.positions(index, start, len(buf)))
        start += len(buf)
    if known_end is not None:
        if known_end > start:
            raise StreamTooShort(start, known_end)
        for micro in sorted(pending):  # unreachable in practice: every slot is complete once the stream ended
            yield micro, release(micro)
        return
    whole = (start - offset) // gbatch if start > offset else 0
    for micro in sorted(pending):
        if micro >= whole * accum:
            break
        yield micro, release(micro)


# ---------------------------------------------------------------------------------------------------------------
# Line streams (iterable and presharded data, `shard`, `audit`): counted and read without parsing JSON.

Item = Tuple[int, int, bytes]  # (file index, 1-based line number, raw line)


def count_rows(path: str) -> int:
    """Non-blank lines of a JSONL file: its samples, counted without parsing."""
    with open_maybe_gzip(path) as fh:
        return sum(1 for line in fh if not line.isspace())


def iter_items(paths: Sequence[str], order: Sequence[int], limits: Optional[Sequence[Optional[int]]] = None) -> Iterator[Item]:
    """(file index, line number, raw line) of every sample, visiting files in `order`; blank lines are not samples."""
    for fi in order:
        limit = None if limits is None else limits[fi]
        if limit == 0:
            continue
        taken = 0
        with open_maybe_gzip(paths[fi]) as fh:
            for line_no, raw in enumerate(fh, 1):
                if raw.isspace():
                    continue
                yield fi, line_no, raw
                taken += 1
                if limit is not None and taken >= limit:
                    break


@dataclass(frozen=True)
class StreamSpec:
    """The files of a stream and how many rows of each belong to it (None: all)."""

    paths: Tuple[str, ...]
    limits: Optional[Tuple[Optional[int], ...]] = None

    def counts(self) -> List[int]:
        """Rows each file contributes (a scan of the files that have no limit)."""
        limits = self.limits if self.limits is not None else (None,) * len(self.paths)
        return [count_rows(p) if lim is None else lim for p, lim in zip(self.paths, limits)]

    def num_rows(self) -> int:
        return sum(self.counts())

    def items(self, epoch: int, seed: int, shuffle: bool) -> Iterator[Item]:
        return iter_items(self.paths, file_order(len(self.paths), seed, epoch, shuffle), self.limits)


def stream_spec(cfg: Any) -> Tuple[StreamSpec, List[Any]]:
    """(stream, source of each file): every source of `dataset` (`registry.resolve_sources` order), globs sorted.

    `max_samples` (per source, then for the whole dataset) keeps the first rows in this natural order, counted as
    lines (map data counts good conversations instead; they differ only when there are bad rows).
    """
    from dsrecipes.data.files import expand_paths
    from dsrecipes.data.registry import resolve_sources

    paths: List[str] = []
    file_sources: List[Any] = []
    limits: List[Optional[int]] = []
    capped = False
    for source in resolve_sources(cfg.dataset):
        if source.weight != 1.0:
            raise DataError(
                f"dataset source {source.name!r}: data=iterable reads every source once, so mixing weight "
                f"{source.weight} cannot be honoured; use data=map (or weight 1)"
            )
        files, missing = expand_paths(source.paths)
        if missing:
            raise DataError(f"dataset source {source.name!r}: {missing[0]!r} matches no file")
        left = source.max_samples
        for f in files:
            paths.append(f)
            file_sources.append(source)
            if left is None:
                limits.append(None)
            else:
                capped = True
                limits.append(min(left, count_rows(f)))
                left -= limits[-1]
    if cfg.dataset.max_samples is not None:
        capped = True
        left = cfg.dataset.max_samples
        for i, f in enumerate(paths):
            limits[i] = min(left, count_rows(f) if limits[i] is None else limits[i])
            left -= limits[i]
    bad = [p for p in paths if not (p.endswith(".jsonl") or p.endswith(".jsonl.gz"))]
    if bad:
        raise DataError(
            f"data=iterable streams JSONL files; {bad[0]} is not .jsonl(.gz). Convert it with "
            "`dsrecipes shard` (writes JSONL parts) or use data=map"
        )
    return StreamSpec(tuple(paths), tuple(limits) if capped else None), file_sources
