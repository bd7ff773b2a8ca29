"""The planner (`dsrecipes.data.plan.epoch`) and the readers' own filters (`sampler`): exactly-once, equal steps, resume.

Pure Python over synthetic sample numbers: every world size 1-8 x DataLoader workers 0-4, map and stream orders,
fewer files than readers and very uneven files. The loaders' own tests (real DataLoader workers) are in
test_strategies.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dsrecipes.data.plan.epoch import EpochPlan, Layout, Position, StreamShuffle, epoch_order, file_order, resume_point
from dsrecipes.data.plan.sampler import StreamTooShort, map_micro_batches, select_slots
from dsrecipes.data.strategies import PrepareResult, plan_steps

WORLDS = range(1, 9)
WORKERS = range(0, 5)


def map_reads(n, layout, seed=3, epoch=0, shuffle=True, offset=0, start_micro=0):
    """rank -> list of micro-batches (row lists), as the map batch sampler hands them out."""
    plan = EpochPlan(n, layout, offset, start_micro)
    return {r: map_micro_batches(plan, r, seed, epoch, shuffle) for r in range(layout.world_size)}


def stream_reads(items, layout, shuffle, offset=0, start_micro=0, steps=None):
    """rank -> micro-batches in the order the rank yields them (DataLoader takes workers round-robin)."""
    out = {}
    for r in range(layout.world_size):
        per_worker = {w: list(select_slots(items, shuffle, layout, r, w, offset=offset, start_micro=start_micro,
                                           steps=steps)) for w in range(layout.readers_per_rank)}
        merged = sorted((m, batch) for batches in per_worker.values() for m, batch in batches)
        for w, batches in per_worker.items():  # worker w produces micro-batches w, w+W, ... (round-robin order)
            assert [m for m, _ in batches] == [m for m, _ in merged if (m - start_micro) % layout.readers_per_rank == w]
        out[r] = [batch for _, batch in merged]
    return out


def check_exactly_once(reads, n, layout, steps=None):
    flat = [s for batches in reads.values() for b in batches for s in b]
    assert len(flat) == len(set(flat)), "a sample read twice"
    counts = {len(b) for b in reads.values()}
    assert len(counts) == 1, f"micro-batches per rank differ: {counts}"
    micro = counts.pop()
    assert micro % layout.grad_accum == 0
    assert all(len(b) == layout.micro_batch_size for batches in reads.values() for b in batches)
    expected_steps = n // layout.global_batch if steps is None else steps
    assert micro == expected_steps * layout.grad_accum
    assert n - len(flat) < layout.global_batch or steps is not None
    return flat


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("workers", WORKERS)
def test_map_plan_exactly_once(world, workers):
    for n, mbs, accum in [(0, 1, 1), (5, 1, 1), (97, 2, 3), (64, 4, 2), (250, 3, 1)]:
        layout = Layout(world, mbs, accum, workers)
        reads = map_reads(n, layout)
        flat = check_exactly_once(reads, n, layout)
        assert set(flat) <= set(range(n))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("workers", WORKERS)
def test_stream_plan_exactly_once(world, workers):
    """Fewer items than readers, uneven lengths, shuffled or not, known length or step budget."""
    for n, mbs, accum, buffer in [(3, 1, 1, 0), (41, 2, 1, 8), (130, 3, 2, 16), (77, 1, 3, 1000)]:
        layout = Layout(world, mbs, accum, workers)
        shuffle = StreamShuffle(5, 1, buffer)
        for known in (True, False):
            steps = n // layout.global_batch if known else None
            reads = stream_reads(list(range(n)), layout, shuffle, steps=steps)
            check_exactly_once(reads, n, layout)


def test_stream_matches_vectorised_plan():
    """select_slots (what a reader does) == EpochPlan.owner over StreamShuffle.full_order (what audit does)."""
    n, layout = 203, Layout(3, 2, 2, 2)
    shuffle = StreamShuffle(11, 4, 13)
    order = shuffle.full_order(n)
    assert sorted(order.tolist()) == list(range(n))
    plan = EpochPlan(n, layout)
    for r in range(3):
        for w in range(2):
            got = [item for _, batch in select_slots(range(n), shuffle, layout, r, w, steps=plan.steps) for item in batch]
            pos = np.sort(order[(order < plan.end)])
            rank, _, worker = plan.owner(pos)
            want_pos = pos[(rank == r) & (worker == w)]
            inverse = np.argsort(order)
            assert got == inverse[want_pos].tolist()


def test_shuffle_is_deterministic_and_changes_per_epoch():
    a = epoch_order(100, 7, 0, True)
    assert np.array_equal(a, epoch_order(100, 7, 0, True))
    assert not np.array_equal(a, epoch_order(100, 7, 1, True))
    assert np.array_equal(epoch_order(10, 7, 3, False), np.arange(10))
    s0, s1 = StreamShuffle(7, 0, 16).full_order(200), StreamShuffle(7, 1, 16).full_order(200)
    assert not np.array_equal(s0, s1)
    assert np.array_equal(s0, StreamShuffle(7, 0, 16).full_order(200))
    assert np.array_equal(StreamShuffle(7, 0, 0).full_order(50), np.arange(50))
    # a windowed shuffle moves an item less than one window
    assert np.abs(s0 - np.arange(200)).max() < 16
    assert file_order(5, 7, 0, True) != file_order(5, 7, 1, True) or file_order(5, 7, 0, True) != file_order(5, 7, 2, True)
    assert file_order(5, 7, 0, False) == [0, 1, 2, 3, 4]


def test_remainder_changes_between_epochs():
    layout = Layout(3, 2, 1)
    n = 100  # remainder 4
    left = []
    for epoch in range(3):
        flat = [s for b in map_reads(n, layout, epoch=epoch).values() for batch in b for s in batch]
        left.append(set(range(n)) - set(flat))
    assert all(len(x) == 4 for x in left)
    assert left[0] != left[1] or left[1] != left[2]


def test_no_shuffle_keeps_order():
    layout = Layout(2, 2, 1)
    reads = map_reads(10, layout, shuffle=False)
    assert reads == {0: [[0, 1], [4, 5]], 1: [[2, 3], [6, 7]]}


@pytest.mark.parametrize("world,workers,accum", [(1, 0, 1), (3, 2, 2), (4, 3, 1), (8, 4, 3)])
def test_resume_mid_epoch_same_layout(world, workers, accum):
    """Stopping after k micro-batches (even inside an accumulation) and resuming gives the rest of the stream."""
    n, layout = 301, Layout(world, 2, accum, workers)
    full_map = map_reads(n, layout)
    shuffle = StreamShuffle(1, 2, 10)
    full_stream = stream_reads(list(range(n)), layout, shuffle, steps=n // layout.global_batch)
    total = len(full_map[0])
    for k in sorted({0, 1, accum, total // 2, total - 1, total}):
        saved = Position(2, 0, k, world, 2, accum)
        epoch, offset, start = resume_point(saved, layout)
        assert epoch == 2
        rest_map = map_reads(n, layout, offset=offset, start_micro=start)
        rest_stream = stream_reads(list(range(n)), layout, shuffle, offset=offset, start_micro=start,
                                   steps=EpochPlan(n, layout, offset).steps)
        for r in range(world):
            assert rest_map[r] == full_map[r][k:]
            assert rest_stream[r] == full_stream[r][k:]


@pytest.mark.parametrize("old,new", [((4, 2, 2), (3, 2, 2)), ((2, 4, 1), (5, 1, 3)), ((1, 3, 1), (8, 1, 1))])
def test_elastic_resume_reads_the_rest_exactly_once(old, new):
    """At a step boundary the state is "global samples consumed"; any other world/batch shape continues from it."""
    n = 400
    for kind in ("map", "stream"):
        lay_old, lay_new = Layout(*old, 2), Layout(*new, 1)
        shuffle = StreamShuffle(9, 0, 32)
        steps_done = 3
        if kind == "map":
            before = map_reads(n, lay_old, epoch=0)
        else:
            before = stream_reads(list(range(n)), lay_old, shuffle, steps=n // lay_old.global_batch)
        done = [s for r in before for b in before[r][: steps_done * lay_old.grad_accum] for s in b]
        saved = Position(0, 0, steps_done * lay_old.grad_accum, *old)
        epoch, offset, start = resume_point(saved, lay_new)
        assert (epoch, offset, start) == (0, steps_done * lay_old.global_batch, 0)
        plan = EpochPlan(n, lay_new, offset)
        if kind == "map":
            after = map_reads(n, lay_new, epoch=0, offset=offset)
        else:
            after = stream_reads(list(range(n)), lay_new, shuffle, offset=offset, steps=plan.steps)
        rest = [s for r in after for b in after[r] for s in b]
        assert len({len(after[r]) for r in after}) == 1
        assert not set(done) & set(rest)
        assert len(rest) == len(set(rest))
        assert n - len(done) - len(rest) < lay_new.global_batch


def test_elastic_resume_inside_an_accumulation_is_refused():
    with pytest.raises(ValueError, match="middle of a gradient accumulation"):
        resume_point(Position(0, 0, 3, 2, 2, 2), Layout(4, 2, 2))
    assert resume_point(Position(0, 0, 3, 2, 2, 2), Layout(2, 2, 2, 3)) == (0, 0, 3)  # workers may change


def test_stream_too_short_and_unknown_length():
    layout = Layout(2, 2, 1)
    with pytest.raises(StreamTooShort):
        list(select_slots(range(5), StreamShuffle(0, 0, 0), layout, 1, 0, steps=2))
    # unknown length: only whole global batches, the same on every rank
    got = {r: list(select_slots(range(9), StreamShuffle(0, 0, 4), layout, r, 0)) for r in range(2)}
    assert [len(v) for v in got.values()] == [2, 2]


def test_plan_steps(make_cfg):
    cfg = make_cfg("trainer.micro_batch_size=4", "trainer.grad_accum=2", "trainer.max_steps=null", "trainer.epochs=3",
                   check_files=False)
    assert plan_steps(cfg, 2, PrepareResult(100, "")) == (6, 18)
    cfg = make_cfg("data=iterable", "trainer.max_steps=70", check_files=False)
    assert plan_steps(cfg, 4, PrepareResult(None, "")) == (None, 70)
    cfg = make_cfg("data=iterable", "data.num_samples=1000", "trainer.max_steps=null", "trainer.epochs=2",
                   "trainer.micro_batch_size=8", check_files=False)
    assert plan_steps(cfg, 4, PrepareResult(None, "")) == (31, 62)
    from dsrecipes.core.errors import DataError

    with pytest.raises(DataError, match="20 training rows do not fill one global batch"):
        plan_steps(cfg, 4, PrepareResult(20, ""))
    cfg = make_cfg("data=presharded", "data.shard_dir=/s", "trainer.micro_batch_size=4", "trainer.grad_accum=2",
                   "trainer.max_steps=null", "trainer.epochs=2", check_files=False)
    assert plan_steps(cfg, 3, PrepareResult(60, "", detail=(21, 20, 19))) == (2, 4)  # the smallest part: 19 // 8
    with pytest.raises(DataError, match=r"the smallest part of /s \(7 samples\) do not fill"):
        plan_steps(cfg, 2, PrepareResult(27, "", detail=(20, 7)))


def test_layout_arithmetic():
    lay = Layout(4, 3, 2, 0)
    assert (lay.global_batch, lay.rank_batch, lay.readers_per_rank, lay.num_readers) == (24, 6, 1, 4)
    assert Layout(4, 3, 2, 3).num_readers == 12
    with pytest.raises(ValueError):
        Layout(0, 1, 1)
    plan = EpochPlan(50, lay)
    assert (plan.steps, plan.end, plan.remainder) == (2, 48, 2)
    assert list(itertools.islice(plan.rank_micros(1), 3)) == [0, 1, 2]
