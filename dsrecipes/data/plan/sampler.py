"""The plan as index lists (`data=map`) and as a stream filter (`data=presharded`: each rank's part, shared by its
DataLoader workers); JSONL line streams. `data=iterable` reads blocks instead (stream/order.py, stream/reader.py).

Both only call `plan.py`; nothing here knows about tokenizers or torch, so `dsrecipes audit` runs the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from dsrecipes.core.schema import DEFAULT_MAX_ROW_BYTES
from dsrecipes.data.plan.epoch import EpochPlan, Layout, StreamShuffle, epoch_order, file_order
from dsrecipes.data.sources.files import iter_lines
from dsrecipes.data.sources.remote import open_maybe_gzip

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


class _Slots:
    """The bookkeeping of one reader's stream filter: which positions are its own, and when a micro-batch is whole."""

    def __init__(self, layout: Layout, rank: int, worker: int, offset: int, start_micro: int, steps: Optional[int]):
        self.layout, self.rank, self.worker, self.offset, self.start_micro = layout, rank, worker, offset, start_micro
        self.known_end = None if steps is None else offset + steps * layout.global_batch
        mine = range(start_micro + worker, (steps or 0) * layout.grad_accum, layout.readers_per_rank)
        self.nothing = steps is not None and not mine
        self.last_micro = mine[-1] if steps is not None and mine else None
        self.pending: Dict[int, List[Tuple[int, Any]]] = {}

    def assign(self, positions: np.ndarray, items: Sequence[Any]) -> None:
        lay = self.layout
        valid = positions >= self.offset
        if self.known_end is not None:
            valid &= positions < self.known_end
        slot = (positions - self.offset) // lay.micro_batch_size
        micro = slot // lay.world_size
        keep = valid & (slot % lay.world_size == self.rank) & (micro >= self.start_micro)
        keep &= (micro - self.start_micro) % lay.readers_per_rank == self.worker
        for i in np.flatnonzero(keep):
            self.pending.setdefault(int(micro[i]), []).append((int(positions[i]), items[i]))

    def ready(self, seen: int) -> Iterator[Tuple[int, List[Any]]]:
        """Micro-batches complete once the stream has reached item `seen` (in order, stops at the first not)."""
        lay = self.layout
        for micro in sorted(self.pending):
            if self.known_end is not None:
                whole = self.offset + (micro * lay.world_size + self.rank + 1) * lay.micro_batch_size <= seen
            else:  # unknown length: only once every rank agrees the optimizer step is complete
                whole = self.offset + (micro // lay.grad_accum + 1) * lay.global_batch <= seen
            if not whole:
                return
            yield micro, self.release(micro)

    def release(self, micro: int) -> List[Any]:
        return [item for _, item in sorted(self.pending.pop(micro), key=lambda pair: pair[0])]

    def finish(self, seen: int) -> Iterator[Tuple[int, List[Any]]]:
        """What is left once the stream ended after `seen` items."""
        if self.known_end is not None:
            if self.known_end > seen:
                raise StreamTooShort(seen, self.known_end)
            yield from ((m, self.release(m)) for m in sorted(self.pending))
            return
        lay = self.layout
        whole = (seen - self.offset) // lay.global_batch if seen > self.offset else 0
        for micro in sorted(self.pending):
            if micro >= whole * lay.grad_accum:
                return
            yield micro, self.release(micro)


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
    """Stream filter of one reader (`data=presharded`): yields (micro, items of that micro-batch) for its slots.

    Every reader walks the same item stream, computes each item's position with `shuffle` (window by window) and
    keeps only positions whose slot it owns, so readers never coordinate and never overlap. `steps` is the planned
    steps of the epoch when the length is known; then reading stops after the reader's last slot, and a stream that
    ends early raises StreamTooShort. With `steps=None` (a stream of unknown length) a slot is released only once
    the stream has reached the end of its optimizer step, so every rank agrees on the number of whole steps.
    """
    slots = _Slots(layout, rank, worker, offset, start_micro, steps)
    if slots.nothing:
        return
    buf: List[T] = []
    start, index = 0, 0
    window_end = shuffle.window_end(0)
    for item in items:
        buf.append(item)
        if start + len(buf) < window_end:
            continue
        slots.assign(shuffle.positions(index, start, len(buf)), buf)
        start, index, buf = start + len(buf), index + 1, []
        window_end = shuffle.window_end(index)
        for micro, batch in slots.ready(start):
            yield micro, batch
            if micro == slots.last_micro:
                return
    if buf:
        slots.assign(shuffle.positions(index, start, len(buf)), buf)
        start += len(buf)
    yield from slots.finish(start)


# ---------------------------------------------------------------------------------------------------------------
# Line streams (iterable and presharded data, `shard`, `audit`): counted and read without parsing JSON.

Item = Tuple[int, int, Optional[bytes]]  # (file index, 1-based line number, raw line; None: over max_row_bytes)


def count_rows(path: str, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> int:
    """Non-blank lines of a JSONL file: its samples, counted without parsing (lines read in bounded pieces)."""

    with open_maybe_gzip(path) as fh:
        return sum(1 for _ in iter_lines(fh, max_row_bytes, path))


def iter_items(paths: Sequence[str], order: Sequence[int], limits: Optional[Sequence[Optional[int]]] = None,
               max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[Item]:
    """(file index, line number, raw line) of every sample, visiting files in `order`; blank lines are not samples,
    a line longer than `max_row_bytes` is one (a bad row: its bytes are None, never held)."""

    for fi in order:
        limit = None if limits is None else limits[fi]
        if limit == 0:
            continue
        taken = 0
        with open_maybe_gzip(paths[fi]) as fh:
            for line_no, raw in iter_lines(fh, max_row_bytes, paths[fi]):
                yield fi, line_no, raw
                taken += 1
                if limit is not None and taken >= limit:
                    break


@dataclass(frozen=True)
class StreamSpec:
    """The files of a stream and how many rows of each belong to it (None: all)."""

    paths: Tuple[str, ...]
    limits: Optional[Tuple[Optional[int], ...]] = None
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES

    def counts(self) -> List[int]:
        """Rows each file contributes (a scan of the files that have no limit)."""
        limits = self.limits if self.limits is not None else (None,) * len(self.paths)
        return [count_rows(p, self.max_row_bytes) if lim is None else lim for p, lim in zip(self.paths, limits)]

    def num_rows(self) -> int:
        return sum(self.counts())

    def items(self, epoch: int, seed: int, shuffle: bool) -> Iterator[Item]:
        return iter_items(self.paths, file_order(len(self.paths), seed, epoch, shuffle), self.limits, self.max_row_bytes)
