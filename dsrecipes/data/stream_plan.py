"""The order of a `data=iterable` epoch and who reads which part of it. Pure numpy; the loaders and `dsrecipes audit`
call these same functions (no files here: blocks are sample counts, see stream_index.py for the bytes).

1. Visits. A source of n kept samples with weight w gives T = round(w * n) samples per epoch, taken from an endless
   cycle over its blocks (blocks in a seeded order fixed for the run, a block's samples in file order): epoch e takes
   cycle items [e*T, (e+1)*T). So w = 1 reads every sample once per epoch; w = 2.5 reads every sample 2 or 3 times
   (a repeat is a new sample: copy k >= 1 gets the id `<id>@<k>`, as in `data=map`); w = 0.25 reads a quarter per
   epoch and every sample once in 4 epochs (unlike `data=map`, whose w < 1 keeps one fixed subset). A visit is
   (block, lo, hi, copy): samples [lo, hi) of one block, in one pass of the cycle.
2. Order. Each source's visits in a seeded random order, the sources merged evenly (a deterministic weighted
   interleave: any stretch of the epoch holds each source's share of the T's to within about one block), the samples
   inside a visit permuted by a hash of (seed, epoch, block, sample, copy). Order positions 0..N-1 do not depend on
   the world size.
3. Segments and stretches. A segment plans the remaining positions ("runs", order-space intervals) for one layout:
   steps = remaining // global batch; reader (rank r, stretch v < W = readers per rank) gets one contiguous stretch
   of the remaining positions, of micros(v) * micro_batch_size samples, where stretch v yields the rank's micro-batches
   m = v, v + W, ... (torch fetches DataLoader workers round-robin). The tail (< one global batch) is not read.
4. Local shuffle. A reader's stretch is read in windows of `shuffle_buffer` samples aligned at its start; each
   window is permuted by hash keys of its positions. Memory: one window of raw lines.
5. Resume. A state records the epoch's closed segments (layout, micro-batches consumed per rank). A reader consumed
   the first micros * micro_batch_size samples of its local order, so the remaining positions after a segment are
   computed exactly from (layout, micro-batches); the same layout continues its segment, any other layout (world
   size, batch shape, workers) plans a new segment over what remains: exactly-once holds across elastic resumes.

How random: consecutive samples of the epoch come from random blocks of the whole corpus (all files, all sources);
inside a reader, samples move anywhere within their window of `shuffle_buffer`. The old scheme kept each file's line
order and only moved a sample within `shuffle_buffer` lines (`benchmarks/bench_stream_reads.py` measures both).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.data.plan import Layout

UNSHUFFLED_WINDOW = 4096  # positions handled at once by a reader when the stream is not shuffled
_M64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------------------------
# Seeds and hash keys (counter-based, so a reader computes the keys of its own positions only)


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def salt(*parts: int) -> int:
    h = 0x5EED
    for p in parts:
        h = _mix(h ^ (int(p) & _M64))
    return h


def hash_keys(values: np.ndarray, salt_value: int) -> np.ndarray:
    """splitmix64 of `values` xor `salt_value`, vectorised (uint64 arithmetic wraps)."""
    x = values.astype(np.uint64) ^ np.uint64(salt_value)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _rng(*parts: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([int(p) & 0xFFFFFFFF for p in parts]))


# ---------------------------------------------------------------------------------------------------------------
# Blocks -> visits -> order


@dataclass(frozen=True)
class BlockTable:
    """What planning needs to know about the blocks: kept samples per block, the source of each block, weights."""

    kept: np.ndarray
    source: np.ndarray
    weights: Tuple[float, ...] = (1.0,)

    @classmethod
    def uniform(cls, counts: Sequence[int], per_block: int, file_source: Optional[Sequence[int]] = None,
                weights: Sequence[float] = (1.0,)) -> "BlockTable":
        """Files of `counts` samples cut into blocks of `per_block` samples (audits and tests without files)."""
        kept: List[int] = []
        source: List[int] = []
        for f, n in enumerate(counts):
            full, rest = divmod(int(n), per_block)
            sizes = [per_block] * full + ([rest] if rest else [])
            kept += sizes
            source += [0 if file_source is None else int(file_source[f])] * len(sizes)
        return cls(np.asarray(kept, dtype=np.int64), np.asarray(source, dtype=np.int64), tuple(weights))

    @cached_property
    def first(self) -> np.ndarray:
        """Kept sample number of each block's first sample (blocks in natural order)."""
        return np.concatenate(([0], np.cumsum(self.kept)[:-1])).astype(np.int64)

    def per_epoch(self, source: int) -> int:
        n = int(self.kept[self.source == source].sum())
        return int(round(self.weights[source] * n))

    def epoch_length(self) -> int:
        return sum(self.per_epoch(s) for s in range(len(self.weights)))


@dataclass(frozen=True)
class Visits:
    block: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    copy: np.ndarray

    @cached_property
    def starts(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.hi - self.lo))).astype(np.int64)

    @property
    def total(self) -> int:
        return int(self.starts[-1])


def epoch_visits(table: BlockTable, seed: int, epoch: int, shuffle: bool) -> Visits:
    """The epoch's visits in order. Shuffled: each source's visits in a seeded random order, spread evenly over the
    epoch (visit i of a source's V gets the key (i + u) / V, u uniform; all sources merged by key), so any stretch of
    the epoch holds each source's share to within about one block. Not shuffled: sources one after the other."""
    cols: List[List[np.ndarray]] = [[], [], [], []]
    keys: List[np.ndarray] = []
    for s in range(len(table.weights)):
        part = _source_visits(table, s, seed, epoch, shuffle)
        keep = part[2] > part[1]
        part = tuple(c[keep] for c in part)
        n = part[0].size
        if shuffle and n:
            rng = _rng(seed, epoch, 1, s)
            perm = rng.permutation(n)
            part = tuple(c[perm] for c in part)
            keys.append((np.arange(n) + rng.random(n)) / n)
        for i in range(4):
            cols[i].append(part[i])
    merged = [np.concatenate(c).astype(np.int64) if c else np.zeros(0, np.int64) for c in cols]
    if keys:
        order = np.argsort(np.concatenate(keys), kind="stable")
        merged = [c[order] for c in merged]
    return Visits(*merged)


def _source_visits(table: BlockTable, s: int, seed: int, epoch: int, shuffle: bool) -> Tuple[np.ndarray, ...]:
    """One source's visits of `epoch`: cycle items [epoch*T, (epoch+1)*T) as (block, lo, hi, copy) rows."""
    blocks = np.flatnonzero((table.source == s) & (table.kept > 0))
    if shuffle:
        blocks = blocks[_rng(seed, 2, s).permutation(blocks.size)]  # the cycle: fixed for the whole run
    sizes = table.kept[blocks]
    n, total = int(sizes.sum()), table.per_epoch(s)
    empty = (np.zeros(0, np.int64),) * 4
    if n == 0 or total == 0:
        return empty
    cum = np.concatenate(([0], np.cumsum(sizes)))
    pos, end, first_pass = epoch * total, (epoch + 1) * total, (epoch * total) // n
    out = []
    while pos < end:
        p, o = divmod(pos, n)
        stop = min(n, o + end - pos)
        i0, i1 = int(np.searchsorted(cum, o, "right")) - 1, int(np.searchsorted(cum, stop, "left"))
        lo = np.maximum(o - cum[i0:i1], 0)
        hi = np.minimum(stop - cum[i0:i1], sizes[i0:i1])
        out.append((blocks[i0:i1], lo, hi, np.full(i1 - i0, p - first_pass)))
        pos += stop - o
    return tuple(np.concatenate([o[i] for o in out]) for i in range(4))


def visit_items(visits: Visits, vids: np.ndarray, seed: int, epoch: int, shuffle: bool) -> Tuple[np.ndarray, ...]:
    """(block, kept index in the block, copy) of every sample of visits `vids`, visit after visit, each visit's
    samples in their epoch order."""
    lo, hi = visits.lo[vids], visits.hi[vids]
    lens = hi - lo
    rep = np.repeat(np.arange(vids.size), lens)
    offs = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    block, copy = visits.block[vids][rep], visits.copy[vids][rep]
    local = lo[rep] + offs
    if shuffle and local.size:
        keys = hash_keys(hash_keys(hash_keys(block, salt(seed, epoch, 4)) ^ local.astype(np.uint64), 1)
                         ^ copy.astype(np.uint64), 2)
        order = np.lexsort((keys, rep))
        local = local[order]
    return block, local, copy


def items_at(visits: Visits, positions: np.ndarray, seed: int, epoch: int, shuffle: bool) -> Tuple[np.ndarray, ...]:
    """(block, kept index, copy) of the samples at order `positions` (any order)."""
    vis = np.searchsorted(visits.starts, positions, "right") - 1
    vids, inverse = np.unique(vis, return_inverse=True)
    block, local, copy = visit_items(visits, vids, seed, epoch, shuffle)
    base = np.concatenate(([0], np.cumsum(visits.hi[vids] - visits.lo[vids])[:-1])).astype(np.int64)
    at = base[inverse] + (positions - visits.starts[vis])
    return block[at], local[at], copy[at]


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
    if rows.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    new = np.concatenate(([True], rows[1:, 0] > rows[:-1, 1]))
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
