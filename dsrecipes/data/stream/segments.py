"""Who reads which part of a `data=iterable` epoch's order (stream/order.py), and resuming. Pure numpy; the loaders
and `dsrecipes audit` call these same functions.

1. Segments and stretches. A segment plans the remaining order positions ("runs": sorted [start, stop) rows) for one
   layout: steps = remaining // global batch; reader (rank r, stretch v < W = readers per rank) gets one contiguous
   stretch of the remaining positions, of micros(v) * micro_batch_size samples, where stretch v yields the rank's
   micro-batches m = v, v + W, ... (torch fetches DataLoader workers round-robin). The tail (< one global batch) is
   not read in this epoch.
2. Local shuffle. A reader's stretch is read in windows of `shuffle_buffer` samples aligned at its start; each
   window is permuted by hash keys of its positions. Memory: one window of raw lines.
3. Resume. A state records the epoch's closed segments (layout, micro-batches consumed per rank). A reader consumed
   the first micros * micro_batch_size samples of its local order, so the remaining positions after a segment are
   computed exactly from (layout, micro-batches); the same layout continues its segment, any other layout (world
   size, batch shape, workers) plans a new segment over what remains: exactly-once holds across elastic resumes.
   Unlike mosaicml streaming, which keeps one sample order for every world size by fixing its number of "canonical
   nodes", the order of what remains after an elastic resume is new; what is kept is the set already consumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.data.plan.epoch import Layout
from dsrecipes.data.stream.order import hash_keys, salt

UNSHUFFLED_WINDOW = 4096  # positions handled at once by a reader when the stream is not shuffled


# ---------------------------------------------------------------------------------------------------------------
# Runs: sets of order positions as sorted, disjoint [start, stop) rows


def runs_len(runs: np.ndarray) -> int:
    return int((runs[:, 1] - runs[:, 0]).sum())


def runs_take(runs: np.ndarray, a: int, b: int) -> np.ndarray:
    """Order positions of remaining-set indices [a, b)."""
    cum = np.concatenate(([0], np.cumsum(runs[:, 1] - runs[:, 0])))
    idx = np.arange(a, b, dtype=np.int64)
    r = np.searchsorted(cum, idx, "right") - 1
    return runs[r, 0] + (idx - cum[r])


def runs_keep(runs: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The runs of remaining-set indices inside `keep` (sorted disjoint [start, stop) rows of indices)."""
    cum = np.concatenate(([0], np.cumsum(runs[:, 1] - runs[:, 0])))
    cuts = np.unique(np.concatenate((cum, keep.ravel())))
    lo, hi = cuts[:-1], cuts[1:]
    k = np.searchsorted(keep[:, 0], lo, "right") - 1
    inside = (k >= 0) & (lo < keep[np.maximum(k, 0), 1]) & (hi > lo)
    lo, hi = lo[inside], hi[inside]
    r = np.searchsorted(cum, lo, "right") - 1
    start = runs[r, 0] + (lo - cum[r])
    return merge_runs(np.stack((start, start + (hi - lo)), axis=1))


def merge_runs(rows: np.ndarray) -> np.ndarray:
    """The union of [start, stop) rows as sorted, disjoint runs (touching rows merged)."""
    if rows.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    new = np.concatenate(([True], rows[1:, 0] > np.maximum.accumulate(rows[:, 1])[:-1]))
    starts = rows[new, 0]
    stops = np.maximum.reduceat(rows[:, 1], np.flatnonzero(new))
    return np.stack((starts, stops), axis=1).astype(np.int64)


def complement(consumed: np.ndarray, length: int) -> np.ndarray:
    """[0, length) minus the union of `consumed` rows."""
    merged = merge_runs(consumed)
    starts = np.concatenate(([0], merged[:, 1]))
    stops = np.concatenate((merged[:, 0], [length]))
    keep = stops > starts
    return np.stack((starts[keep], stops[keep]), axis=1).astype(np.int64)


# ---------------------------------------------------------------------------------------------------------------
# Segments: one layout's readers over the remaining positions


@dataclass(frozen=True)
class LocalShuffle:
    """How a reader orders its stretch: windows of `buffer` positions, permuted (or in order)."""

    seed: int
    epoch: int
    buffer: int
    shuffle: bool

    @property
    def permutes(self) -> bool:
        return self.shuffle and self.buffer > 1

    @property
    def window(self) -> int:
        return self.buffer if self.permutes else UNSHUFFLED_WINDOW


@dataclass(frozen=True, eq=False)
class Segment:
    runs: np.ndarray  # remaining order positions when the segment starts
    layout: Layout
    depth: int = 0  # segments before it in this epoch (0: a fresh epoch)

    @cached_property
    def steps(self) -> int:
        return runs_len(self.runs) // self.layout.global_batch

    @property
    def micro_per_rank(self) -> int:
        return self.steps * self.layout.grad_accum

    def micros(self, v: int, start: int = 0, stop: Optional[int] = None) -> int:
        """Micro-batches of stretch v among the rank's micro-batches [start, stop)."""
        stop = self.micro_per_rank if stop is None else stop
        w = self.layout.readers_per_rank
        return max(0, len(range(v, stop, w)) - len(range(v, start, w)))

    @cached_property
    def starts(self) -> np.ndarray:
        """Start of reader (rank r, stretch v) = starts[r * W + v] among the remaining positions."""
        lay = self.layout
        lens = [self.micros(v) * lay.micro_batch_size for v in range(lay.readers_per_rank)] * lay.world_size
        return np.concatenate(([0], np.cumsum(lens))).astype(np.int64)

    def stretch(self, rank: int, v: int) -> Tuple[int, int]:
        i = rank * self.layout.readers_per_rank + v
        return int(self.starts[i]), int(self.starts[i + 1] - self.starts[i])


def window_local(seg: Segment, rank: int, v: int, j: int, sh: LocalShuffle) -> Tuple[int, np.ndarray, np.ndarray]:
    """Window j of a stretch: (first remaining index, its positions, the local order as offsets into them)."""
    start, length = seg.stretch(rank, v)
    a, b = start + j * sh.window, start + min((j + 1) * sh.window, length)
    pos = runs_take(seg.runs, a, b)
    if not sh.permutes:
        return a, pos, np.arange(pos.size)
    return a, pos, np.argsort(hash_keys(pos, salt(sh.seed, sh.epoch, 3, seg.depth, start)), kind="stable")


def stretch_positions(seg: Segment, rank: int, v: int, skip_micros: int, sh: LocalShuffle) -> Iterator[np.ndarray]:
    """Order positions of a reader's samples in the order it yields them, window by window, after skipping the
    first `skip_micros` micro-batches (already consumed)."""
    _, length = seg.stretch(rank, v)
    skip = skip_micros * seg.layout.micro_batch_size
    for j in range(skip // sh.window, -(-length // sh.window)):
        _, pos, perm = window_local(seg, rank, v, j, sh)
        ordered = pos[perm]
        yield ordered[skip - j * sh.window:] if j == skip // sh.window else ordered


def remaining_after(seg: Segment, micro_done: int, sh: LocalShuffle) -> np.ndarray:
    """The runs left after every rank consumed `micro_done` micro-batches of `seg` (each reader: a prefix of its
    local order), plus the tail nobody was planned to read."""
    lay = seg.layout
    rows: List[Tuple[int, int]] = []
    for rank in range(lay.world_size):
        for v in range(lay.readers_per_rank):
            start, _ = seg.stretch(rank, v)
            used = seg.micros(v, 0, micro_done) * lay.micro_batch_size
            full = used // sh.window
            rows.append((start, start + full * sh.window))
            if used > full * sh.window:
                a, _, perm = window_local(seg, rank, v, full, sh)
                idx = a + np.sort(perm[: used - full * sh.window])
                rows += list(zip(idx.tolist(), (idx + 1).tolist()))
    keep = complement(np.asarray(rows, dtype=np.int64).reshape(-1, 2), runs_len(seg.runs))
    return runs_keep(seg.runs, keep)


def epoch_segment(num_items: int, history: Sequence[Tuple[Layout, int]], layout: Layout, sh: LocalShuffle) -> Segment:
    """The segment `layout` reads now, after the epoch's closed segments `history` ((layout, micro-batches done))."""
    runs = np.array([[0, num_items]], dtype=np.int64) if num_items > 0 else np.zeros((0, 2), dtype=np.int64)
    for depth, (lay, done) in enumerate(history):
        runs = remaining_after(Segment(runs, lay, depth), done, sh)
    return Segment(runs, layout, len(history))
