"""Train loaders with real DataLoader workers: every rank of a world simulated in one process (the loaders need no
process group), synthetic rows (map) and JSONL files (iterable, presharded); resume and elastic resume.

The real data layer (prepare, tokenizer, collate) is exercised at the end on the bundled sample data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.data.plan.epoch import Layout
from dsrecipes.data.plan.sampler import StreamSpec, count_rows
from dsrecipes.data.strategies.base import TrainLoader
from dsrecipes.data.strategies.iterable import StreamTrainLoader
from dsrecipes.data.strategies.map import MapTrainLoader
from dsrecipes.data.strategies.presharded import PreshardedTrainLoader
from tests.helpers.launching import stream_index_like_launcher


def collate_ids(rows):
    return {"ids": [i for r in rows for i in r["ids"]], "rows": len(rows)}


def rows_of_items(items):
    return [{"ids": [f"{fi}:{line}"]} for fi, line, *_ in items]


def write_files(tmp_path: Path, sizes):
    paths = []
    for f, n in enumerate(sizes):
        p = tmp_path / f"shard{f}.jsonl"
        with open(p, "w") as fh:
            for i in range(n):
                fh.write(json.dumps({"k": i}) + "\n")
                if i % 7 == 3:
                    fh.write("\n")  # blank lines are not samples
        paths.append(str(p))
    return paths


def all_ids(paths):
    out = set()
    for f, p in enumerate(paths):
        with open(p) as fh:
            out |= {f"{f}:{i}" for i, line in enumerate(fh, 1) if line.strip()}
    return out


def make_map(n, world, rank, workers=0, mbs=2, accum=1, shuffle=True, seed=0):
    rows = [{"ids": [f"s{i}"]} for i in range(n)]
    return MapTrainLoader(rows, Layout(world, mbs, accum, workers), rank, seed=seed, shuffle=shuffle,
                          collate_fn=collate_ids, num_workers=workers)


_INDEXES: dict = {}  # one launch per file set: every rank (and every resumed loader) opens the same index


def launched_index(paths):
    key = tuple(map(str, paths))
    if key not in _INDEXES:
        _INDEXES[key] = stream_index_like_launcher(paths, Path(paths[0]).parent / "run")
    return _INDEXES[key]


def make_stream(paths, world, rank, workers=0, mbs=2, accum=1, num_samples=None, buffer=8, seed=0):
    return StreamTrainLoader(launched_index(paths), Layout(world, mbs, accum, workers), rank, seed=seed,
                             shuffle=True, shuffle_buffer=buffer, num_samples=num_samples, make_rows=rows_of_items,
                             collate_fn=collate_ids, num_workers=workers)


class PartRows:
    """make_rows of a part: ids `<rank>:<line>` (picklable, for spawned DataLoader workers)."""

    def __init__(self, rank):
        self.rank = rank

    def __call__(self, items):
        return [{"ids": [f"{self.rank}:{line}"]} for _, line, _ in items]


def make_presharded(paths, world, rank, workers=0, mbs=2, accum=1, buffer=8):
    counts = [count_rows(p) for p in paths]
    return PreshardedTrainLoader(StreamSpec((paths[rank],)), Layout(1, mbs, accum, workers), 0, seed=0, shuffle=True,
                                 shuffle_buffer=buffer, num_samples=counts[rank], make_rows=PartRows(rank),
                                 collate_fn=collate_ids, num_workers=workers, part_counts=counts, global_rank=rank)


def run_epoch(loaders, epoch, limit=None):
    """rank -> list of batches' ids for one epoch (or the first `limit` micro-batches of an endless loader)."""
    out = {}
    for r, lo in enumerate(loaders):
        lo.set_epoch(epoch)
        got = []
        for batch in lo:
            assert batch["epoch"] >= epoch
            got.append(batch["ids"])
            if limit is not None and len(got) == limit:
                break
        out[r] = got
    return out


def check(out, universe, global_batch, per_rank_micro=None):
    counts = {len(v) for v in out.values()}
    assert len(counts) == 1, f"ranks ran different micro-batch counts {counts}"
    if per_rank_micro is not None:
        assert counts == {per_rank_micro}
    flat = [i for v in out.values() for b in v for i in b]
    assert len(flat) == len(set(flat)), "sample read twice"
    assert set(flat) <= universe
    assert len(universe) - len(flat) < global_batch
    return flat


@pytest.mark.parametrize("world,workers", [(1, 0), (2, 2), (3, 1), (4, 3)])
def test_map_loader_world(world, workers):
    n, mbs, accum = 53, 2, 2
    loaders = [make_map(n, world, r, workers, mbs, accum) for r in range(world)]
    universe = {f"s{i}" for i in range(n)}
    g = world * mbs * accum
    e0 = check(run_epoch(loaders, 0), universe, g, loaders[0].steps_per_epoch * accum)
    e1 = check(run_epoch(loaders, 1), universe, g)
    assert e0 != e1  # reshuffled
    assert all(lo.steps_per_epoch == n // g for lo in loaders)


def test_map_loader_no_shuffle_order():
    lo = make_map(8, 2, 1, shuffle=False)
    assert [b["ids"] for b in lo] == [["s2", "s3"], ["s6", "s7"]]


@pytest.mark.parametrize("world,workers,sizes", [
    (3, 2, [1, 2]),            # fewer files than readers
    (2, 3, [70, 1, 0, 4]),     # very uneven, an empty file
    (4, 0, [33]),              # one file, many ranks
    (1, 2, [5, 5, 5]),
])
def test_iterable_loader_known_length(tmp_path, world, workers, sizes):
    paths = write_files(tmp_path, sizes)
    n = sum(sizes)
    mbs = 1 if n < 10 else 2
    loaders = [make_stream(paths, world, r, workers, mbs=mbs, num_samples=n) for r in range(world)]
    g = world * mbs
    if n // g == 0:
        pytest.skip("less than one global batch")
    universe = all_ids(paths)
    for epoch in range(2):
        check(run_epoch(loaders, epoch), universe, g, n // g)


def test_iterable_loader_counts_its_stream(tmp_path):
    """Without data.num_samples the index's count plans every epoch (no endless stream any more)."""
    paths = write_files(tmp_path, [9, 14])
    world, mbs = 2, 2
    loaders = [make_stream(paths, world, r, workers=2, mbs=mbs) for r in range(world)]
    per_epoch = 23 // (world * mbs)  # 5 steps
    assert {lo.steps_per_epoch for lo in loaders} == {per_epoch}
    for epoch in range(3):
        check(run_epoch(loaders, epoch), all_ids(paths), world * mbs, per_epoch)
        assert {lo.epoch for lo in loaders} == {epoch}


def test_resume_at_the_end_of_an_epoch(tmp_path):
    """A state saved on the last step of an epoch: that epoch yields nothing more, the next one starts afresh."""
    paths = write_files(tmp_path, [10])
    full = make_stream(paths, 1, 0, mbs=2)
    full.set_epoch(1)
    next_epoch = [b["ids"] for b in full]
    cut = make_stream(paths, 1, 0, mbs=2)
    assert len(list(cut)) == 5
    state = cut.state_dict()
    assert state["position"]["epoch"] == 0 and state["samples_consumed"] == 10
    resumed = make_stream(paths, 1, 0, mbs=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    assert list(resumed) == []
    resumed.set_epoch(1)
    assert [b["ids"] for b in resumed] == next_epoch


def test_presharded_loader_equal_steps(tmp_path):
    paths = write_files(tmp_path, [11, 10, 11])  # parts of +-1 samples
    world, mbs, accum = 3, 2, 2
    loaders = [make_presharded(paths, world, r, workers=2, mbs=mbs, accum=accum) for r in range(world)]
    assert {lo.steps_per_epoch for lo in loaders} == {2}
    universe = {f"{r}:{i}" for r, p in enumerate(paths) for i in [int(x.split(":")[1]) for x in all_ids([p])]}
    for epoch in range(2):
        check(run_epoch(loaders, epoch), universe, world * mbs * accum, 4)


@pytest.mark.parametrize("factory", ["map", "iterable", "presharded"])
def test_resume_mid_epoch_reproduces_the_rest(tmp_path, factory):
    """state_dict after k micro-batches (inside an accumulation too) -> a fresh loader yields exactly the rest."""
    paths = write_files(tmp_path, [21, 19, 20])
    world, mbs, accum = 3, 2, 2

    def make(rank, workers):
        if factory == "map":
            return make_map(60, world, rank, workers, mbs, accum)
        if factory == "iterable":
            return make_stream(paths, world, rank, workers, mbs, accum, num_samples=60)
        return make_presharded(paths, world, rank, workers, mbs, accum)

    # map and presharded: a rank's sequence does not depend on its DataLoader workers, so they may change; iterable:
    # each worker reads its own stretch, so the same workers continue exactly (another count re-splits what is
    # left: test_stream.py::test_resume_with_other_workers_reads_the_rest_once)
    before, after = (2, 2) if factory == "iterable" else (0, 1)
    for rank in (0, world - 1):
        full = make(rank, before)
        full.set_epoch(1)
        expected = [b["ids"] for b in full]
        for k in (3, 4):  # inside an accumulation, at a step boundary
            first = make(rank, 2)
            first.set_epoch(1)
            it = iter(first)
            head = [next(it)["ids"] for _ in range(k)]
            state = json.loads(json.dumps(first.state_dict()))
            resumed = make(rank, after)
            resumed.load_state_dict(state)
            assert resumed.epoch == 1
            resumed.set_epoch(1)  # the runner's call keeps the position
            assert head + [b["ids"] for b in resumed] == expected
            resumed.set_epoch(2)
            assert len(list(resumed)) == len(expected)


@pytest.mark.parametrize("factory", ["map", "iterable"])
def test_elastic_resume_other_world_size(tmp_path, factory):
    paths = write_files(tmp_path, [50, 47])
    n = 97

    def make(world, rank, mbs, accum):
        if factory == "map":
            return make_map(n, world, rank, 1, mbs, accum)
        return make_stream(paths, world, rank, 1, mbs, accum, num_samples=n)

    old = [make(2, r, 2, 2) for r in range(2)]
    consumed = []
    states = []
    for lo in old:
        it = iter(lo)
        for _ in range(2 * 2):  # two optimizer steps
            consumed += next(it)["ids"]
        states.append(lo.state_dict())
    assert {s["samples_consumed"] for s in states} == {16}
    new = [make(3, r, 1, 3) for r in range(3)]
    for lo in new:
        lo.load_state_dict(states[0])  # any rank's state: the position is global
    rest = run_epoch(new, 0)
    assert len({len(v) for v in rest.values()}) == 1
    flat = [i for v in rest.values() for b in v for i in b]
    assert len(flat) == len(set(flat)) and not set(flat) & set(consumed)
    assert n - len(consumed) - len(flat) < 3 * 1 * 3
    assert sum(1 for _ in new[0]) == 0  # the epoch is done on every rank


def test_resume_refuses_changed_setup():
    from dsrecipes.core.errors import DataError

    lo = make_map(40, 2, 0, seed=1)
    state = lo.state_dict()
    with pytest.raises(DataError, match="seed"):
        make_map(40, 2, 0, seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="num_samples"):
        make_map(41, 2, 0, seed=1).load_state_dict(state)


def test_iterable_stream_too_short_is_an_error(tmp_path):
    from dsrecipes.core.errors import DataError

    paths = write_files(tmp_path, [10])
    lo = make_stream(paths, 1, 0, num_samples=20)
    with pytest.raises(DataError, match="data.num_samples=20"):
        list(lo)


def test_loader_is_a_trainloader():
    assert isinstance(make_map(4, 1, 0), TrainLoader)


# ---------------------------------------------------------------------------------------------------------------
# The real data layer: bundled sample data, tiny tokenizer, collate.


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from tests.helpers.launching import plan_like_launcher

    run_dir = tmp_path_factory.mktemp("run")
    cache = tmp_path_factory.mktemp("cache")
    overrides = ["debug=fast", f"data.cache_dir={cache}", "dataset.max_samples=200", "dataset.val_size=16"]
    cfg = compose_and_load(overrides)
    tok = load_tokenizer(cfg)
    plan = plan_like_launcher(cfg, run_dir, 2)
    return overrides, run_dir, tok, plan


def test_real_map_loader(prepared_run):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.strategies import build_loaders

    overrides, run_dir, tok, plan = prepared_run
    cfg = compose_and_load(overrides + ["data.num_workers=1"])
    loaders, ev = zip(*[build_loaders(cfg, tok, r, 2, run_dir, plan) for r in range(2)])
    out = run_epoch(loaders, 0)
    loaders[0].set_epoch(1)
    batch = next(iter(loaders[0]))
    assert batch["input_ids"].shape[0] == cfg.trainer.micro_batch_size
    assert {"labels", "position_ids", "attention_mask", "num_tokens", "ids", "epoch"} <= set(batch)
    flat = [i for v in out.values() for b in v for i in b]
    assert len(flat) == len(set(flat)) and len({len(v) for v in out.values()}) == 1
    val_ids = [i for lo in ev for b in lo for i in b["ids"]]
    assert len(val_ids) == len(set(val_ids)) == 16 and not set(val_ids) & set(flat)


def test_real_iterable_loader_tokenizes_on_the_fly(prepared_run, tmp_path):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    overrides, _, tok, _ = prepared_run
    n = 200  # dataset.max_samples; dataset.val_size=16 of them are held out of the stream
    cfg = compose_and_load(overrides + ["data=iterable", "data.num_workers=2"])
    plan = plan_like_launcher(cfg, tmp_path, 2)  # the launching process indexes the stream; ranks only read it
    assert plan.rows == n - 16
    loaders, evals = zip(*[build_loaders(cfg, tok, r, 2, tmp_path, plan) for r in range(2)])
    assert loaders[0].planned == n - 16
    out = run_epoch(loaders, 0)
    flat = [i for v in out.values() for b in v for i in b]
    assert len(flat) == len(set(flat))
    assert {len(v) for v in out.values()} == {loaders[0].steps_per_epoch * cfg.trainer.grad_accum}
    held = [i for ev in evals for b in ev for i in b["ids"]]
    assert len(held) == len(set(held)) == 16 and not set(held) & set(flat)
    assert len(flat) >= n - 16 - 2 * cfg.trainer.micro_batch_size - 8  # only remainder, holdout and truncation


def test_a_presharded_part_is_rechecked_at_each_new_epoch(tmp_path):
    """A part in a store is read again every epoch: the loader re-checks it (one HEAD against the manifest's
    identity: PreshardedTrainLoader.recheck) before each new epoch, so a part replaced mid-run is refused at the
    next epoch instead of trained on (seen in review: a replaced S3 part trained two epochs silently)."""
    from dsrecipes.core.errors import DataError

    part = tmp_path / "part_00.jsonl"
    part.write_text("".join(f'{{"i": {i}}}\n' for i in range(8)))
    calls = []
    loader = make_presharded([str(part)], 1, 0)
    loader.recheck = lambda: calls.append(loader.epoch)
    for epoch in (0, 0, 1):  # epoch 0: checked when the rank opened the part; the same epoch again is no new read
        run_epoch([loader], epoch)
    assert calls == [0], calls  # once, before epoch 1

    def replaced():
        raise DataError("s3://b/part_00.jsonl: missing or changed since `dsrecipes shard` wrote it")

    loader.recheck = replaced
    with pytest.raises(DataError, match="missing or changed"):
        loader.set_epoch(2)
