"""One reader of a `data=iterable` epoch: its stretch of the order (stream/order.py) -> blocks read -> micro-batches.

The loaders run this in every DataLoader worker; `dsrecipes audit` replays it over a fake block source to check it
against the vectorised plan. Items are handed out in each window's local order, as soon as their block is read: a
block is read when an item first needs it and kept to the end of the window (past it only when the next window needs
it too), so the first micro-batch waits for its own blocks only and each block is read once per stretch of windows
it serves. A source with a `plan` method (objects in a store, stream/index.py) is told, before the first read, every
block it will be asked for, in order (`Windows.takes`, computed window by window as far as the source looks ahead).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Iterable, Iterator, List, Optional, Set, Tuple

import numpy as np

from dsrecipes.data.stream.order import Visits, items_at
from dsrecipes.data.stream.segments import LocalShuffle, Segment, stretch_positions

Item = Tuple[int, int, bytes, int]  # (file index, location, raw line, copy)
ReadBlock = Callable[[int], List[Tuple[int, int, bytes]]]  # global block -> (file, location, raw) of kept samples


@dataclass
class Window:
    """One window of a stretch: (block, kept index, copy) of each item in the order it is handed out."""

    block: np.ndarray
    local: np.ndarray
    copy: np.ndarray
    takes: List[int]  # blocks read in this window, in the order of first need (those kept from the last one: not)
    keep: Set[int] = field(default_factory=set)  # blocks kept past it: the next window needs them too


class Windows:
    """The windows of a reader's stretch, each computed once: one ahead of the reader (its `keep` needs the next
    window) and as far ahead as `takes` is drawn."""

    def __init__(self, positions: Iterable[np.ndarray], visits: Visits, sh: LocalShuffle):
        self._positions = iter(positions)
        self.visits, self.sh = visits, sh
        self._for_reader: Deque[Window] = deque()
        self._for_plan: Deque[Window] = deque()
        self._last: Optional[Window] = None
        self._last_blocks: Set[int] = set()

    def _compute(self) -> bool:
        positions = next(self._positions, None)
        if positions is None:
            return False
        block, local, copy = items_at(self.visits, positions, self.sh.seed, self.sh.epoch, self.sh.shuffle)
        firsts = list(dict.fromkeys(block.tolist()))
        blocks = set(firsts)
        if self._last is not None:
            self._last.keep = self._last_blocks & blocks
        window = Window(block, local, copy, [g for g in firsts if g not in self._last_blocks])
        self._last, self._last_blocks = window, blocks
        self._for_reader.append(window)
        self._for_plan.append(window)
        return True

    def __iter__(self) -> Iterator[Window]:
        while self._for_reader or self._compute():
            if len(self._for_reader) == 1:
                self._compute()  # the next window decides what this one keeps
            yield self._for_reader.popleft()

    def takes(self) -> Iterator[int]:
        """Every block the reader will read, in the order it reads them."""
        while self._for_plan or self._compute():
            yield from self._for_plan.popleft().takes


class ItemFetcher:
    """Order positions -> items, reading each block when first needed (see the module docstring)."""

    def __init__(self, visits: Visits, read_block: ReadBlock, sh: LocalShuffle):
        self.visits = visits
        self.read_block = read_block
        self.sh = sh

    def items(self, positions: Iterable[np.ndarray]) -> Iterator[Item]:
        """The items of each window of `positions` (order positions, window by window, in hand-out order)."""
        windows = Windows(positions, self.visits, self.sh)
        plan = getattr(getattr(self.read_block, "__self__", None), "plan", None)
        if plan is not None:  # a store's blocks: read ahead, in spans (data/sources/remote_ahead.py)
            plan(windows.takes())
        held: dict = {}
        for w in windows:
            for g, local, copy in zip(w.block.tolist(), w.local.tolist(), w.copy.tolist()):
                rows = held.get(g)
                if rows is None:
                    rows = held[g] = self.read_block(g)
                f, loc, raw = rows[local]
                yield f, loc, raw, copy
            held = {g: held[g] for g in w.keep}


def read_stretch(seg: Segment, rank: int, v: int, skip_micros: int, sh: LocalShuffle,
                 fetch: ItemFetcher) -> Iterator[Tuple[int, List[Any]]]:
    """(rank micro-batch number, items) of reader (rank, stretch v) from its micro-batch `skip_micros` on."""
    mbs, readers = seg.layout.micro_batch_size, seg.layout.readers_per_rank
    batch: List[Any] = []
    k = skip_micros
    for item in fetch.items(stretch_positions(seg, rank, v, skip_micros, sh)):
        batch.append(item)
        if len(batch) == mbs:
            yield v + k * readers, batch
            batch, k = [], k + 1
