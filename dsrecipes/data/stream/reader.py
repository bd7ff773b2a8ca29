"""One reader of a `data=iterable` epoch: its stretch of the order (stream/order.py) -> blocks read -> micro-batches.

The loaders run this in every DataLoader worker; `dsrecipes audit` replays it over a fake block source to check it
against the vectorised plan. Positions of a window are fetched in order-position order (so blocks are read
sequentially, each at most once while the reader stays in it) and handed out in the window's local order.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterator, List, Tuple

import numpy as np

from dsrecipes.data.stream.order import Visits, items_at
from dsrecipes.data.stream.segments import LocalShuffle, Segment, stretch_positions

Item = Tuple[int, int, bytes, int]  # (file index, location, raw line, copy)
ReadBlock = Callable[[int], List[Tuple[int, int, bytes]]]  # global block -> (file, location, raw) of kept samples


class ItemFetcher:
    """Order positions -> items, reading each needed block once (a few recent blocks are kept)."""

    def __init__(self, visits: Visits, read_block: ReadBlock, sh: LocalShuffle, keep_blocks: int = 4):
        self.visits = visits
        self.read_block = read_block
        self.sh = sh
        self.keep_blocks = keep_blocks
        self._blocks: "OrderedDict[int, List[Tuple[int, int, bytes]]]" = OrderedDict()

    def _block(self, g: int) -> List[Tuple[int, int, bytes]]:
        if g in self._blocks:
            self._blocks.move_to_end(g)
        else:
            self._blocks[g] = self.read_block(g)
            if len(self._blocks) > self.keep_blocks:
                self._blocks.popitem(last=False)
        return self._blocks[g]

    def __call__(self, positions: np.ndarray) -> List[Item]:
        block, local, copy = items_at(self.visits, positions, self.sh.seed, self.sh.epoch, self.sh.shuffle)
        out: List[Any] = [None] * positions.size
        block, local, copy = block.tolist(), local.tolist(), copy.tolist()
        order = np.argsort(positions, kind="stable").tolist()
        prefetch = getattr(getattr(self.read_block, "__self__", None), "prefetch", None)
        if prefetch is not None:  # a store's blocks: the window's next blocks requested together (remote.py)
            prefetch([g for g in dict.fromkeys(block[i] for i in order) if g not in self._blocks])
        for i in order:
            f, loc, raw = self._block(block[i])[local[i]]
            out[i] = (f, loc, raw, copy[i])
        return out


def read_stretch(seg: Segment, rank: int, v: int, skip_micros: int, sh: LocalShuffle,
                 fetch: Callable[[np.ndarray], List[Any]]) -> Iterator[Tuple[int, List[Any]]]:
    """(rank micro-batch number, items) of reader (rank, stretch v) from its micro-batch `skip_micros` on."""
    mbs, readers = seg.layout.micro_batch_size, seg.layout.readers_per_rank
    pending: List[Any] = []
    k = skip_micros
    for positions in stretch_positions(seg, rank, v, skip_micros, sh):
        pending += fetch(positions)
        while len(pending) >= mbs:
            yield v + k * readers, pending[:mbs]
            pending, k = pending[mbs:], k + 1
