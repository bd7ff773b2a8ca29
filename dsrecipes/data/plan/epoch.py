"""Who reads which sample: the one planner behind every data strategy and `dsrecipes audit`.

Pure Python + numpy; no torch, no tokenizer, no files: the strategies (data/strategies/) read what they need and
hand the counts in. Everything here is arithmetic on *positions*: position p of
epoch e is the p-th sample of that epoch's order (a seeded permutation for `map`, a windowed shuffle of the stream
for `iterable`/`presharded`). Positions are independent of the world size and of DataLoader workers, so a rank's
progress can be expressed as "global samples consumed in this epoch", which is what makes elastic resume possible.

Slots. An epoch plan starts at `offset` (0, or the samples already consumed before a resume) and cuts the positions
after it into micro-batch slots of `micro_batch_size`. Slot c holds positions [offset + c*mbs, offset + (c+1)*mbs)
and belongs to

    rank  = c % world_size               (consecutive slots go to consecutive ranks)
    micro = c // world_size              (the rank's micro-batch number in this plan)
    step  = micro // grad_accum          (optimizer step; one step = one global batch of slots)
    worker = (micro - start_micro) % W   (DataLoader worker; torch fetches from workers round-robin, in order)

Only whole global batches are planned: steps = (num_samples - offset) // global_batch, the same on every rank. The
remainder (< one global batch) is the tail of the epoch's order, so it changes from epoch to epoch when shuffling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from dsrecipes.core.errors import DataError

if TYPE_CHECKING:
    from dsrecipes.core.schema import TrainConfig

STATE_VERSION = 1
UNSHUFFLED_WINDOW = 4096  # items read between position bookkeeping when the stream is not shuffled


@dataclass(frozen=True)
class Layout:
    """The shape of the data-parallel world as the data plan sees it."""

    world_size: int
    micro_batch_size: int
    grad_accum: int
    num_workers: int = 0  # DataLoader workers per rank; 0 = the rank's own process is its only reader

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")

    @property
    def global_batch(self) -> int:
        """Samples (or rows) per optimizer step over all ranks."""
        return self.world_size * self.micro_batch_size * self.grad_accum

    @property
    def rank_batch(self) -> int:
        """Samples per optimizer step on one rank."""
        return self.micro_batch_size * self.grad_accum

    @property
    def readers_per_rank(self) -> int:
        return max(1, self.num_workers)

    @property
    def num_readers(self) -> int:
        return self.world_size * self.readers_per_rank

    @classmethod
    def from_cfg(cls, cfg: "TrainConfig", world_size: int) -> "Layout":
        t = cfg.trainer
        return cls(world_size, t.micro_batch_size, t.grad_accum, cfg.data.num_workers)


# ---------------------------------------------------------------------------------------------------------------
# Slot arithmetic. Works on Python ints and on numpy arrays alike (the audit runs it vectorised over all positions).


def slot_of(position, layout: Layout, offset: int = 0):
    return (position - offset) // layout.micro_batch_size


def rank_of_slot(slot, layout: Layout):
    return slot % layout.world_size


def micro_of_slot(slot, layout: Layout):
    return slot // layout.world_size


def worker_of_micro(micro, layout: Layout, start_micro: int = 0):
    return (micro - start_micro) % layout.readers_per_rank


@dataclass(frozen=True)
class EpochPlan:
    """The planned part of one epoch: `steps` whole global batches starting at position `offset`.

    `steps` is normally (num_samples - offset) // global_batch; presharded data passes the minimum over parts.
    `start_micro` skips micro-batches already consumed after `offset` (a resume in the middle of an accumulation).
    """

    num_samples: int
    layout: Layout
    offset: int = 0
    start_micro: int = 0
    steps: int = -1  # -1: derive from num_samples

    def __post_init__(self) -> None:
        if self.steps < 0:
            object.__setattr__(self, "steps", max(0, (self.num_samples - self.offset) // self.layout.global_batch))

    @property
    def micro_per_rank(self) -> int:
        """Micro-batches each rank runs in this plan (including already consumed `start_micro`)."""
        return self.steps * self.layout.grad_accum

    @property
    def end(self) -> int:
        """First position not consumed by this plan."""
        return self.offset + self.steps * self.layout.global_batch

    @property
    def remainder(self) -> int:
        """Samples of the epoch that no rank reads (the tail of the order)."""
        return self.num_samples - self.end

    def owner(self, position):
        """(rank, micro, worker) of positions (ints or arrays); callers mask positions outside [offset, end)."""
        slot = slot_of(position, self.layout, self.offset)
        micro = micro_of_slot(slot, self.layout)
        return rank_of_slot(slot, self.layout), micro, worker_of_micro(micro, self.layout, self.start_micro)

    def rank_micros(self, rank: int, worker: Optional[int] = None) -> range:
        """The rank's micro-batch numbers still to run (those of one worker when `worker` is given)."""
        if worker is None:
            return range(self.start_micro, self.micro_per_rank)
        return range(self.start_micro + worker, self.micro_per_rank, self.layout.readers_per_rank)

    def rank_positions(self, rank: int, worker: Optional[int] = None) -> np.ndarray:
        """[n_micro, micro_batch_size] positions, in the order the rank (or worker) yields them."""
        micros = np.asarray(self.rank_micros(rank, worker), dtype=np.int64)
        mbs, world = self.layout.micro_batch_size, self.layout.world_size
        starts = self.offset + (micros * world + rank) * mbs
        return starts[:, None] + np.arange(mbs, dtype=np.int64)[None, :]


# ---------------------------------------------------------------------------------------------------------------
# Orders. `map`: a full permutation of the rows. Streams: a windowed shuffle that a reader can apply while reading.


def _rng(seed: int, epoch: int, *stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, epoch, *stream]))


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Position -> row index for one epoch of a map dataset (identity without shuffling)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return _rng(seed, epoch).permutation(num_samples).astype(np.int64)


def file_order(num_files: int, seed: int, epoch: int, shuffle: bool) -> List[int]:
    """The order in which a stream visits its files this epoch."""
    if not shuffle or num_files <= 1:
        return list(range(num_files))
    return [int(i) for i in _rng(seed, epoch, 1).permutation(num_files)]


@dataclass(frozen=True)
class StreamShuffle:
    """A windowed shuffle of a stream: item i moves to a position inside its window, never further.

    Windows have `buffer` items; the first one is shorter by a per-epoch random shift, so window edges move between
    epochs. Each window is permuted by a generator seeded with (seed, epoch, window), so every reader of the stream
    computes the same positions without talking to the others, and the order never depends on the world size.
    Memory is one window of raw lines, whatever the size of the data.
    """

    seed: int
    epoch: int
    buffer: int  # 0 or 1: stream order

    @property
    def enabled(self) -> bool:
        return self.buffer > 1

    @property
    def window_size(self) -> int:
        return self.buffer if self.enabled else UNSHUFFLED_WINDOW

    @cached_property
    def first_window(self) -> int:
        if not self.enabled:
            return UNSHUFFLED_WINDOW
        return int(_rng(self.seed, self.epoch, 2).integers(1, self.buffer + 1))

    def window_end(self, index: int) -> int:
        """Item index where window `index` ends (exclusive), for an unbounded stream."""
        return self.first_window + index * self.window_size

    def positions(self, index: int, start: int, length: int) -> np.ndarray:
        """Positions of the `length` items of window `index`, which starts at item `start`."""
        if not self.enabled:
            return np.arange(start, start + length, dtype=np.int64)
        return start + _rng(self.seed, self.epoch, 3, index).permutation(length).astype(np.int64)

    def full_order(self, num_items: int) -> np.ndarray:
        """item -> position for a whole stream of `num_items` (the audit; readers go window by window)."""
        if not self.enabled:
            return np.arange(num_items, dtype=np.int64)
        out = np.empty(num_items, dtype=np.int64)
        start, index = 0, 0
        while start < num_items:
            end = min(self.window_end(index), num_items)
            out[start:end] = self.positions(index, start, end - start)
            start, index = end, index + 1
        return out


# ---------------------------------------------------------------------------------------------------------------
# Positions for resume. A rank's state is JSON; it is saved per rank by the runner.


@dataclass
class Position:
    """Where one rank stands: epoch, the plan's start offset, micro-batches consumed since, and the layout used."""

    epoch: int = 0
    offset: int = 0
    micro: int = 0
    world_size: int = 1
    micro_batch_size: int = 1
    grad_accum: int = 1

    def __post_init__(self) -> None:  # a trusted foreign checkpoint's position is data: typed here, at its use
        for name in ("epoch", "offset", "micro", "world_size", "micro_batch_size", "grad_accum"):
            count(name, getattr(self, name), 1 if name in ("world_size", "micro_batch_size", "grad_accum") else 0)

    def layout_key(self) -> Tuple[int, int, int]:
        return (self.world_size, self.micro_batch_size, self.grad_accum)

    @property
    def samples_consumed(self) -> Optional[int]:
        """Global samples of this epoch consumed by all ranks together; None in the middle of an accumulation."""
        if self.micro % self.grad_accum:
            return None
        return self.offset + (self.micro // self.grad_accum) * self.world_size * self.micro_batch_size * self.grad_accum

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)


MAX_COUNT = 2**53  # past any real epoch, offset or micro-batch count (and exact in a JSON reader's float)


def count(name: str, value: object, low: int = 0) -> int:
    """`value` as a saved data position's count: an int (not a bool) in [low, MAX_COUNT], else ValueError naming
    `name` (a checkpoint's data_state of another shape: rank/checkpoint._as_written makes it one message)."""
    if type(value) is not int or not low <= value <= MAX_COUNT:
        raise ValueError(f"{name} must be a whole number from {low} to 2**53, got {str(value)[:40]}")
    return value


def resume_point(saved: Position, layout: Layout) -> Tuple[int, int, int]:
    """(epoch, offset, start_micro) for a rank of `layout` continuing from `saved` (any rank's state of that run).

    Same layout: exact, even in the middle of an accumulation. Other world size / batch shape (elastic): exact as
    long as the state was saved at an optimizer-step boundary, which is where checkpoints are taken.
    """
    consumed = saved.samples_consumed
    if consumed is not None:
        return saved.epoch, consumed, 0
    if saved.layout_key() == (layout.world_size, layout.micro_batch_size, layout.grad_accum):
        return saved.epoch, saved.offset, saved.micro
    raise ValueError(
        f"the data state was saved in the middle of a gradient accumulation (micro-batch {saved.micro}, "
        f"grad_accum {saved.grad_accum}); it can only resume with the same world size and batch shape "
        f"({saved.world_size} x {saved.micro_batch_size} x {saved.grad_accum})"
    )


# ---------------------------------------------------------------------------------------------------------------
# Up-front step counts for the launching process.


def steps_per_epoch(num_samples: int, layout: Layout) -> int:
    return EpochPlan(num_samples, layout).steps


def require_steps(per_epoch: Optional[int], what: str, layout: Layout) -> Optional[int]:
    """`per_epoch`, or DataError when `what` (the data of an epoch, in words) does not fill one global batch."""
    if per_epoch == 0:
        raise DataError(
            f"{what} do not fill one global batch of {layout.global_batch} "
            f"(world {layout.world_size} x micro_batch_size {layout.micro_batch_size} x grad_accum "
            f"{layout.grad_accum}); use more data, fewer ranks or a smaller batch"
        )
    return per_epoch


def total_steps(cfg: "TrainConfig", per_epoch: Optional[int]) -> int:
    """Optimizer steps of the whole run: `trainer.max_steps`, else `trainer.epochs` epochs of `per_epoch`."""
    if cfg.trainer.max_steps is not None:
        return cfg.trainer.max_steps
    assert per_epoch is not None, "validated: a stream of unknown length needs trainer.max_steps"
    return per_epoch * cfg.trainer.epochs


def presharded_steps(counts: List[int], layout: Layout, offset: int = 0) -> int:
    """Steps per epoch when rank r reads only part r: the smallest part decides, so all ranks step together."""
    return max(0, min((c - offset) // layout.rank_batch for c in counts))


