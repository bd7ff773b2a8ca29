"""The order of a `data=iterable` epoch: blocks -> visits -> order positions. Pure numpy; the loaders and
`dsrecipes audit` call these same functions (no files here: blocks are sample counts, see stream/index.py for the
bytes; who reads which part of the order: stream/segments.py).

1. Visits. A source of n kept samples with weight w gives T = round(w * n) samples per epoch, taken from an endless
   cycle over its blocks (its chunks in a seeded order fixed for the run, a chunk's blocks and a block's samples in
   file order; a chunk is a run of adjacent blocks of one file, `data.chunk_bytes`, stream/sizes.py): epoch e takes
   cycle items [e*T, (e+1)*T). So w = 1 reads every sample once per epoch; w = 2.5 reads every sample 2 or 3 times
   (a repeat is a new sample: copy k >= 1 gets the id `<id>@<k>`, as in `data=map`); w = 0.25 reads a quarter per
   epoch and every sample once in 4 epochs (unlike `data=map`, whose w < 1 keeps one fixed subset). A visit is
   (block, lo, hi, copy): samples [lo, hi) of one block, in one pass of the cycle.
2. Order. Each source's visits in a seeded random order - a chunk's visits of one pass of the cycle moved as one
   group, its blocks kept adjacent and in file order - the sources merged evenly (a deterministic weighted
   interleave: any stretch of the epoch holds each source's share of the T's to within about one chunk), the samples
   inside a visit permuted by a hash of (seed, epoch, block, sample, copy). Order positions 0..N-1 do not depend on
   the world size. With one block per chunk (local files by default) this is exactly the order from before chunks.

How random: consecutive chunks of the epoch come from random places of the whole corpus (all files, all sources);
inside a reader, samples move anywhere within their window of `shuffle_buffer` (stream/segments.py). The old scheme
kept each file's line order and only moved a sample within `shuffle_buffer` lines (`benchmarks/bench_stream_reads.py`
measures both). Chunks are the price of fewer GETs for objects in a store (a reader's blocks come in runs that one
ranged GET serves): a chunk's samples stay within one chunk's stretch of the order (block by block, each block's
samples permuted, then mixed further by the reader's `shuffle_buffer` window), so neighbours in a file stay nearer
each other in the epoch than with single blocks, and a global batch draws from fewer places. Measured by
bench_stream_reads.py on a 0.5 GB local corpus (16 KiB blocks): the mean |Spearman| of a file's samples, training
step vs line order, goes from 0.02 (one block) to 0.05 (128 KiB chunks), 0.13 (1 MiB) and 0.26 (4 MiB) at one
reader; 1024-line regions per global batch at 16 x 4 readers from 59 to 52, 33 and 26 (docs/scale.md). Every sample
is still read exactly once per epoch (w = 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Sequence, Tuple

import numpy as np

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
    """What planning needs to know about the blocks: kept samples per block, the source of each block, weights, and
    the chunk of each block (a run of adjacent blocks of one file, numbered in natural order; None: one block each)."""

    kept: np.ndarray
    source: np.ndarray
    weights: Tuple[float, ...] = (1.0,)
    chunk: Optional[np.ndarray] = None

    @classmethod
    def uniform(cls, counts: Sequence[int], per_block: int, file_source: Optional[Sequence[int]] = None,
                weights: Sequence[float] = (1.0,), blocks_per_chunk: int = 1) -> "BlockTable":
        """Files of `counts` samples cut into blocks of `per_block` samples, chunks of `blocks_per_chunk` blocks
        (audits and tests without files)."""
        kept: List[int] = []
        source: List[int] = []
        file: List[int] = []
        local: List[int] = []
        for f, n in enumerate(counts):
            full, rest = divmod(int(n), per_block)
            sizes = [per_block] * full + ([rest] if rest else [])
            kept += sizes
            source += [0 if file_source is None else int(file_source[f])] * len(sizes)
            file += [f] * len(sizes)
            local += range(len(sizes))
        chunk = chunks_of(np.asarray(file, dtype=np.int64), np.asarray(local, dtype=np.int64), blocks_per_chunk)
        return cls(np.asarray(kept, dtype=np.int64), np.asarray(source, dtype=np.int64), tuple(weights), chunk)

    @cached_property
    def first(self) -> np.ndarray:
        """Kept sample number of each block's first sample (blocks in natural order)."""
        return np.concatenate(([0], np.cumsum(self.kept)[:-1])).astype(np.int64)

    @cached_property
    def chunks(self) -> np.ndarray:
        return np.arange(self.kept.size, dtype=np.int64) if self.chunk is None else self.chunk

    def per_epoch(self, source: int) -> int:
        n = int(self.kept[self.source == source].sum())
        return int(round(self.weights[source] * n))

    def epoch_length(self) -> int:
        return sum(self.per_epoch(s) for s in range(len(self.weights)))


def chunks_of(file: np.ndarray, local: np.ndarray, blocks_per_chunk: int) -> np.ndarray:
    """Chunk number of each block (blocks in natural order: `file`, block `local` in the file): blocks
    [k*c, (k+1)*c) of a file form chunk k of it; chunks numbered in natural order."""
    key = np.stack((file, local // max(1, int(blocks_per_chunk))), axis=1)
    new = np.concatenate(([True], np.any(key[1:] != key[:-1], axis=1))) if key.size else np.zeros(0, bool)
    return (np.cumsum(new) - 1).astype(np.int64)


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
    """The epoch's visits in order. Shuffled: each source's groups (consecutive visits of one chunk in one pass of
    its cycle; one visit each when a chunk is one block) in a seeded random order, spread evenly over the epoch (group
    i of a source's G gets the key (i + u) / G, u uniform; all sources merged by key), so any stretch of the epoch
    holds each source's share to within about one chunk. Not shuffled: sources one after the other."""
    cols: List[List[np.ndarray]] = [[], [], [], []]
    keys: List[np.ndarray] = []
    lens: List[np.ndarray] = []
    for s in range(len(table.weights)):
        part = _source_visits(table, s, seed, epoch, shuffle)
        keep = part[2] > part[1]
        part = tuple(c[keep] for c in part)
        size = _group_sizes(table.chunks[part[0]], part[3])
        if shuffle and size.size:
            rng = _rng(seed, epoch, 1, s)
            perm = rng.permutation(size.size)
            part = tuple(c[_expand(size, perm)] for c in part)
            size = size[perm]
            keys.append((np.arange(size.size) + rng.random(size.size)) / size.size)
        lens.append(size)
        for i in range(4):
            cols[i].append(part[i])
    merged = [np.concatenate(c).astype(np.int64) if c else np.zeros(0, np.int64) for c in cols]
    if keys:
        order = _expand(np.concatenate(lens), np.argsort(np.concatenate(keys), kind="stable"))
        merged = [c[order] for c in merged]
    return Visits(*merged)


def _group_sizes(chunk: np.ndarray, copy: np.ndarray) -> np.ndarray:
    """Sizes of the runs of consecutive visits with the same (chunk, copy)."""
    if chunk.size == 0:
        return np.zeros(0, np.int64)
    new = np.concatenate(([True], (chunk[1:] != chunk[:-1]) | (copy[1:] != copy[:-1])))
    return np.diff(np.append(np.flatnonzero(new), chunk.size)).astype(np.int64)


def _expand(size: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Item indices of groups of `size` items (laid out one after the other), the groups taken in `order`."""
    start = np.concatenate(([0], np.cumsum(size)[:-1])).astype(np.int64)
    n = size[order]
    return np.repeat(start[order] - np.cumsum(n) + n, n) + np.arange(int(n.sum()), dtype=np.int64)


def _source_visits(table: BlockTable, s: int, seed: int, epoch: int, shuffle: bool) -> Tuple[np.ndarray, ...]:
    """One source's visits of `epoch`: cycle items [epoch*T, (epoch+1)*T) as (block, lo, hi, copy) rows. The cycle
    (fixed for the run): the source's chunks in a seeded order, a chunk's blocks in file order."""
    blocks = np.flatnonzero((table.source == s) & (table.kept > 0))
    if shuffle:
        size = _group_sizes(table.chunks[blocks], np.zeros(blocks.size, np.int64))
        blocks = blocks[_expand(size, _rng(seed, 2, s).permutation(size.size))]
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
