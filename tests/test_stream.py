"""`data=iterable` block reading (issue 13): the index, conversions, and many readers simulated in one process.

Every reader of the world is run in this process through the loader's own `reader()` (what each DataLoader worker
runs), over real files, with a byte counter on its block source: exactly-once per epoch, equal steps, exact and
elastic resume (other world size, batch shape, worker count, twice), and each reader reading only the blocks of its
own samples (at most two of them shared with a neighbour).
"""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dsrecipes.data.plan.epoch import Layout
from dsrecipes.data.strategies.iterable import StreamTrainLoader
from dsrecipes.data.stream.files import LineScanner
from dsrecipes.data.stream.index import BlockSource, StreamIndex
from tests.helpers.launching import stream_index_like_launcher


def item_ids(items):
    return [{"ids": [f"{f}:{loc}" + (f"@{copy}" if copy else "")]} for f, loc, _, copy in items]


def write_corpus(root: Path, sizes, seed=0, blank_every=11):
    """JSONL files of varied line lengths, blank lines, one file without a final newline."""
    rnd = random.Random(seed)
    paths = []
    for f, n in enumerate(sizes):
        lines = []
        for i in range(n):
            lines.append(json.dumps({"k": f"{f}-{i}", "pad": "x" * rnd.randint(0, 300)}))
            if i % blank_every == 5:
                lines.append("   ")
        path = root / f"part{f}.jsonl"
        path.write_text("\n".join(lines) + ("" if f == 1 else "\n"), encoding="utf-8")
        paths.append(str(path))
    return paths


def all_ids(paths):
    out = []
    for f, p in enumerate(paths):
        with open(p, "rb") as fh:
            out += [f"{f}:{i}" for i, line in enumerate(fh, 1) if line.strip()]
    return out


class CountingSource(BlockSource):
    """A BlockSource that also records which blocks it read."""

    def __init__(self, index):
        super().__init__(index)
        self.blocks_read = []

    def block(self, g):
        self.blocks_read.append(g)
        return super().block(g)


def make_loader(index, layout, rank, seed=0, buffer=16, shuffle=True):
    return StreamTrainLoader(index, layout, rank, seed=seed, shuffle=shuffle, shuffle_buffer=buffer,
                             num_samples=None, make_rows=item_ids, collate_fn=lambda rows: rows,
                             num_workers=layout.num_workers)


def rank_micro_batches(loader, epoch, sources=None, stop_after=None):
    """A rank's micro-batches (lists of ids) as its DataLoader yields them: workers' readers round-robin."""
    loader.set_epoch(epoch)
    start = loader._micro
    readers = []
    for w in range(loader.layout.readers_per_rank):
        src = CountingSource(loader.index) if sources is None else sources.setdefault((loader.rank, w),
                                                                                      CountingSource(loader.index))
        readers.append(loader.reader(w, epoch, start, src))
    out, w = [], 0
    total = loader.segment(epoch).micro_per_rank - start
    for _ in range(total if stop_after is None else min(total, stop_after)):
        _, items = next(readers[w])
        out.append([r["ids"][0] for r in item_ids(items)])
        w = (w + 1) % len(readers)
    loader._micro += len(out)
    return out


def test_line_scanner_matches_a_plain_reading():
    rnd = random.Random(3)
    parts = []
    for i in range(400):
        parts.append(rnd.choice([b"", b"  ", b"\t\r", b"x" * rnd.randint(1, 90), b'{"a": %d}' % i]))
    data = b"\n".join(parts) + b"\r\n  tail without newline"
    for block_bytes in (1, 64, 1000):
        for chunk in (1, 7, 4096):
            sc = LineScanner(block_bytes)
            for at in range(0, len(data), chunk):
                sc.feed(data[at:at + chunk])
            count, offsets, lines, firsts = sc.finish()
            starts, numbers, pos = [], [], 0
            for no, raw in enumerate(data.split(b"\n"), 1):
                if raw.strip():
                    starts.append(pos)
                    numbers.append(no)
                pos += len(raw) + 1
            assert count == len(starts)
            assert offsets.tolist() == [starts[i] for i in firsts.tolist()]
            assert lines.tolist() == [numbers[i] for i in firsts.tolist()]
            cells = np.asarray(starts) // block_bytes  # a block starts at the first sample line of each stretch
            assert firsts.tolist() == np.flatnonzero(np.diff(np.concatenate(([-1], cells))) > 0).tolist()


def test_many_readers_exactly_once_equal_steps_and_only_their_own_blocks(tmp_path):
    """World 64 x 4 DataLoader workers = 256 readers over 9 files: each reads only the blocks of its samples."""
    paths = write_corpus(tmp_path, [900, 35, 2000, 1, 0, 640, 1300, 77, 1500])
    index = stream_index_like_launcher(paths, tmp_path / "run", 4096)
    layout = Layout(64, 2, 2, 4)
    universe = all_ids(paths)
    block_size = _block_sizes(index)
    kept = index.table().kept
    for epoch in range(2):
        sources = {}
        per_rank = {r: rank_micro_batches(make_loader(index, layout, r), epoch, sources) for r in range(64)}
        assert len({len(v) for v in per_rank.values()}) == 1
        steps = len(per_rank[0]) // layout.grad_accum
        assert steps == len(universe) // layout.global_batch
        flat = [i for v in per_rank.values() for b in v for i in b]
        assert len(flat) == len(set(flat)) and set(flat) <= set(universe)
        assert len(universe) - len(flat) < layout.global_batch
        read = 0
        for (rank, w), src in sources.items():
            assert len(src.blocks_read) == len(set(src.blocks_read)), "a reader read a block twice"
            assert src.bytes_read == sum(block_size[g] for g in src.blocks_read)
            own = Counter(_block_of(index, i) for b in per_rank[rank][w::4] for i in b)
            shared = [g for g in src.blocks_read if own[g] < kept[g]]
            assert set(src.blocks_read) == set(own) and len(shared) <= 2, (rank, w, shared)
            read += src.bytes_read
        corpus = sum(Path(p).stat().st_size for p in paths)
        assert read <= corpus + 2 * len(sources) * max(block_size.values())


def _block_sizes(index):
    b = index.blocks
    out = {}
    for g in range(b["count"].size):
        fi = index.files[int(b["file"][g])]
        local = int(b["local"][g])
        stop = int(fi.offsets[local + 1]) if local + 1 < fi.offsets.size else fi.size
        out[g] = stop - int(fi.offsets[local])
    return out


def _block_of(index, sample_id):
    f, loc = (int(x) for x in sample_id.split(":"))
    fi = index.files[f]
    b = int(np.searchsorted(fi.lines, loc, "right")) - 1
    return int(np.flatnonzero((index.blocks["file"] == f) & (index.blocks["local"] == b))[0])


@pytest.mark.parametrize("old,new,third", [
    ((8, 2, 2, 2), (3, 3, 1, 3), (5, 1, 4, 0)),   # other world, batch shape and workers, then again
    ((4, 2, 1, 0), (4, 2, 1, 3), (2, 4, 2, 1)),   # workers only, then world
])
def test_elastic_resume_reads_the_rest_exactly_once(tmp_path, old, new, third):
    paths = write_corpus(tmp_path, [700, 20, 900, 333])
    index = stream_index_like_launcher(paths, tmp_path / "run", 2048)
    _resume_twice_exactly_once(index, all_ids(paths), old, new, third)


def _resume_twice_exactly_once(index, universe, old, new, third):
    """5 steps in layout `old`, 3 in `new`, the rest of epoch 0 in `third`: every sample once, equal steps."""
    seen = []
    state = None
    for lay_args, steps in ((old, 5), (new, 3), (third, None)):
        layout = Layout(*lay_args)
        loaders = [make_loader(index, layout, r) for r in range(layout.world_size)]
        for lo in loaders:
            if state is not None:
                lo.load_state_dict(json.loads(json.dumps(state)))
        stop = None if steps is None else steps * layout.grad_accum
        got = {r: rank_micro_batches(lo, 0, stop_after=stop) for r, lo in enumerate(loaders)}
        assert len({len(v) for v in got.values()}) == 1
        seen += [i for v in got.values() for b in v for i in b]
        states = [lo.state_dict() for lo in loaders]
        assert len({json.dumps({k: v for k, v in s.items() if k != "rank"}) for s in states}) == 1
        state = states[-1]
    assert len(seen) == len(set(seen)), "a sample read twice across the resumes"
    assert len(universe) - len(seen) < Layout(*third).global_batch
    assert state["samples_consumed"] == len(seen)
    return state


def test_resume_with_other_workers_reads_the_rest_once(tmp_path):
    """Inside an accumulation, with another worker count: the rest, once; with the same: exactly the same rest."""
    paths = write_corpus(tmp_path, [300, 150])
    index = stream_index_like_launcher(paths, tmp_path / "run", 1024)
    lay2 = Layout(2, 2, 2, 2)
    full = {r: rank_micro_batches(make_loader(index, lay2, r), 1) for r in range(2)}
    first = [make_loader(index, lay2, r) for r in range(2)]
    head = {r: rank_micro_batches(lo, 1, stop_after=3) for r, lo in enumerate(first)}
    state = first[0].state_dict()
    same = [make_loader(index, lay2, r) for r in range(2)]
    for r, lo in enumerate(same):
        lo.load_state_dict(state)
        assert head[r] + rank_micro_batches(lo, 1) == full[r]
    other = [make_loader(index, Layout(2, 2, 2, 3), r) for r in range(2)]
    rest = []
    for lo in other:
        lo.load_state_dict(state)
        rest.append(rank_micro_batches(lo, 1))
    assert len(rest[0]) == len(rest[1])
    done = [i for v in head.values() for b in v for i in b]
    after = [i for v in rest for b in v for i in b]
    assert not set(done) & set(after) and len(after) == len(set(after))
    assert 450 - len(done) - len(after) < 8


def test_weights_interleave_sources_and_walk_through_small_weights(tmp_path):
    """weight 2: every row twice per epoch (the repeat is `id@1`); weight 0.5: half per epoch, all in two epochs."""
    paths = write_corpus(tmp_path, [400, 300])
    index = stream_index_like_launcher(paths, tmp_path / "run", 1024, weights=[2.0, 0.5])
    layout = Layout(2, 2, 1, 1)
    assert make_loader(index, layout, 0).planned == 800 + 150
    halves = []
    for epoch in range(2):
        out = {r: rank_micro_batches(make_loader(index, layout, r), epoch) for r in range(2)}
        flat = [i for v in out.values() for b in v for i in b]
        assert len(flat) == len(set(flat)) and 950 - len(flat) < 4
        a = [i for i in flat if i.startswith("0:")]
        assert sum("@1" in i for i in a) >= 396 and not any("@2" in i for i in a)
        halves.append({i for i in flat if i.startswith("1:")})
        from_a = np.array([i.startswith("0:") for b in out[0] for i in b])  # rank 0: the first half of the order
        chunks = np.array_split(from_a, 4)
        assert all(0.76 < c.mean() < 0.92 for c in chunks), [c.mean() for c in chunks]  # ~800/950 everywhere
    assert len(halves[0] & halves[1]) < 4 and len(halves[0] | halves[1]) >= 296


def test_order_is_a_real_shuffle(tmp_path):
    """Spearman correlation of epoch position vs place in the files: ~0 (the old window shuffle kept ~1)."""
    from dsrecipes.data.plan.epoch import StreamShuffle

    paths = write_corpus(tmp_path, [3000])
    index = stream_index_like_launcher(paths, tmp_path / "run", 2048)
    out = rank_micro_batches(make_loader(index, Layout(1, 4, 1, 0), 0, buffer=64), 0)
    natural = [int(i.split(":")[1]) for b in out for i in b]
    new = abs(_spearman(natural))
    old = abs(_spearman(np.argsort(StreamShuffle(0, 0, 64).full_order(3000)).tolist()))
    assert new < 0.1 and old > 0.99, (new, old)


def _spearman(seq):
    ranks = np.argsort(np.argsort(np.asarray(seq)))
    return float(np.corrcoef(np.arange(len(seq)), ranks)[0, 1])


# ---------------------------------------------------------------------------------------------------------------
# Chunks: runs of adjacent blocks of one file kept together by the epoch order (data.chunk_bytes)

# (block, kept index, copy) of the whole epoch order of a small table, from the code before chunks existed
_BEFORE_CHUNKS = {
    0: [[0, 0, 0], [0, 1, 0], [0, 2, 0], [4, 2, 0], [4, 1, 0], [4, 0, 0], [0, 0, 1], [0, 1, 1], [0, 2, 1], [8, 0, 0],
        [8, 1, 0], [1, 2, 0], [1, 0, 0], [1, 1, 0], [6, 0, 0], [6, 1, 0], [6, 2, 0], [2, 0, 0]],
    1: [[2, 0, 0], [3, 1, 0], [3, 0, 0], [1, 0, 0], [1, 1, 0], [1, 2, 0], [7, 1, 0], [7, 0, 0], [7, 2, 0], [1, 0, 1],
        [1, 2, 1], [1, 1, 1], [5, 1, 0], [5, 0, 0], [5, 2, 0], [0, 1, 1], [0, 2, 1], [0, 0, 1]],
}
_BEFORE_CHUNKS_SHA = "74bc1e48db26e8a0501487e4c34a26cf9d84676305c0e9d016df1bcc39053c37"  # 3 sources, 3 epochs


def _epoch_order(table, seed, epoch, shuffle=True):
    from dsrecipes.data.stream.order import epoch_visits, visit_items

    visits = epoch_visits(table, seed, epoch, shuffle)
    items = visit_items(visits, np.arange(visits.block.size), seed, epoch, shuffle)
    return visits, np.stack(items, axis=1).astype(np.int64)


def test_one_block_chunks_keep_the_order_from_before_chunks():
    import hashlib

    from dsrecipes.data.stream.order import BlockTable

    small = BlockTable.uniform([7, 0, 12, 5], 3, file_source=[0, 0, 1, 1], weights=(1.5, 0.5))
    assert [_epoch_order(small, 5, e)[1].tolist() for e in range(2)] == [_BEFORE_CHUNKS[0], _BEFORE_CHUNKS[1]]
    for k in (None, 1):
        args = {} if k is None else {"blocks_per_chunk": k}
        big = BlockTable.uniform([500, 31, 900, 77], 16, file_source=[0, 1, 0, 2], weights=(1.0, 2.5, 0.25), **args)
        digest = hashlib.sha256()
        for e in range(3):
            digest.update(_epoch_order(big, 11, e)[1].tobytes())
            digest.update(_epoch_order(big, 11, e, shuffle=False)[1].tobytes())
        assert digest.hexdigest() == _BEFORE_CHUNKS_SHA


@pytest.mark.parametrize("k", [2, 5])
def test_chunks_keep_their_blocks_adjacent_in_file_order_and_every_sample_once(k):
    from dsrecipes.data.stream.order import BlockTable

    counts = [500, 31, 900, 77, 0, 260]
    table = BlockTable.uniform(counts, 16, file_source=[0, 1, 0, 1, 1, 0], weights=(1.0, 1.0), blocks_per_chunk=k)
    blocks = [-(-n // 16) for n in counts]
    assert table.chunks.max() + 1 == sum(-(-b // k) for b in blocks)  # chunks never cross files
    everything = sorted((g, i) for g in range(table.kept.size) for i in range(table.kept[g]))
    for epoch in range(2):
        visits, items = _epoch_order(table, 7, epoch)
        assert sorted(map(tuple, items[:, :2].tolist())) == everything and not items[:, 2].any()
        chunk = table.chunks[visits.block]
        starts = np.flatnonzero(np.diff(np.concatenate(([-1], chunk))))
        runs = np.split(visits.block, starts[1:])
        assert len(runs) == len(set(chunk.tolist())) == table.chunks.max() + 1  # each chunk: one run of visits
        for run in runs:  # ... its blocks, all of them, in file order
            assert run.tolist() == np.flatnonzero(table.chunks == table.chunks[run[0]]).tolist()
        positions = np.flatnonzero(chunk[1:] != chunk[:-1])
        assert len(positions) > 2 * k and not (visits.block[1:] == visits.block[:-1] + 1).all()  # still shuffled
        inside = [items[items[:, 0] == g, 1].tolist() for g in range(table.kept.size)]
        assert sum(x != sorted(x) for x in inside) > table.kept.size // 2  # samples in a block still permuted


def test_chunked_readers_read_every_sample_once_and_resume_elastically(tmp_path):
    """Chunks of 4 blocks through the loaders: exactly once, equal steps, each block read once per epoch; elastic
    resumes; a checkpoint of another chunking is refused, one from before chunks resumes a one-block run."""
    from dsrecipes.core.errors import DataError

    paths = write_corpus(tmp_path, [700, 20, 900, 333])
    index = stream_index_like_launcher(paths, tmp_path / "run", 1024, chunk_bytes=4096)
    assert index.chunk_bytes == 4096 and index.table().chunks.max() + 1 < index.blocks["count"].size / 3
    universe = all_ids(paths)
    layout, sources = Layout(8, 2, 2, 2), {}
    per_rank = {r: rank_micro_batches(make_loader(index, layout, r), 0, sources) for r in range(8)}
    assert len({len(v) for v in per_rank.values()}) == 1
    flat = [i for v in per_rank.values() for b in v for i in b]
    assert len(flat) == len(set(flat)) and len(universe) - len(flat) < layout.global_batch
    reads = [g for src in sources.values() for g in src.blocks_read]
    assert len(reads) - len(set(reads)) <= 2 * len(sources)  # at most the blocks shared by neighbouring stretches
    state = _resume_twice_exactly_once(index, universe, (8, 2, 2, 2), (3, 3, 1, 3), (5, 1, 4, 0))
    plain = stream_index_like_launcher(paths, tmp_path / "run-plain", 1024)
    with pytest.raises(DataError, match=r"chunk_bytes: 4096 -> 1024"):
        make_loader(plain, Layout(5, 1, 4, 0), 0).load_state_dict(state)
    before = make_loader(plain, Layout(2, 2, 1, 0), 0)
    old = before.state_dict()
    del old["fingerprint"]["chunk_bytes"]  # a checkpoint written before chunks: one block per chunk
    make_loader(plain, Layout(2, 2, 1, 0), 0).load_state_dict(old)


def test_holdout_is_deterministic_and_never_trained(make_cfg, tmp_path):
    from dsrecipes.data.stream.index import build_stream_index

    paths = write_corpus(tmp_path, [120, 90])
    cfg = make_cfg("data=iterable", f"dataset.paths=[{','.join(paths)}]", "dataset.val_size=20",
                   f"data.cache_dir={tmp_path / 'cache'}", "data.block_bytes=512")
    a, b = build_stream_index(cfg), build_stream_index(cfg)
    assert a.holdout.tolist() == b.holdout.tolist() and len(a.holdout) == 20
    val = {f"{f}:{loc}" for f, loc, _ in BlockSource(a).rows(a.val_refs())}
    assert len(val) == 20
    out = {r: rank_micro_batches(make_loader(a, Layout(2, 3, 1, 2), r), 0) for r in range(2)}
    flat = {i for v in out.values() for bt in v for i in bt}
    assert not flat & val and len(set(all_ids(paths)) - flat - val) < 6


# ---------------------------------------------------------------------------------------------------------------
# Conversions: JSON arrays and gzip, positions kept


def test_json_array_and_gzip_stream_with_their_positions(make_cfg, tmp_path, monkeypatch):
    from dsrecipes.data.sources.files import read_rows
    from dsrecipes.data.stream import convert as stream_convert
    from dsrecipes.data.stream.index import index_stream

    monkeypatch.setattr(stream_convert, "CHUNK", 97)  # the parser's buffer slides many times
    rows = [{"id": None, "conversations": [{"from": "human", "value": f"q[{i}], \"x\"\n{{"},
                                           {"from": "gpt", "value": "答" * i}]} for i in range(40)]
    for r in rows[::3]:
        r.pop("id")
    arr = tmp_path / "chat.json"
    arr.write_text(json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    gz = tmp_path / "more.json.gz"
    gz.write_bytes(gzip.compress(json.dumps(rows[:5]).encode()))
    lines = tmp_path / "lines.jsonl.gz"
    lines.write_bytes(gzip.compress(b"\n".join(json.dumps(r).encode() for r in rows[:7]) + b"\n"))
    jl = tmp_path / "jl.json"
    jl.write_text("\n".join(json.dumps(r) for r in rows[:4]), encoding="utf-8")
    cfg_args = ("data=iterable", f"dataset.paths=[{arr},{gz},{lines},{jl}]", f"data.cache_dir={tmp_path / 'c'}")
    index = index_stream(make_cfg(*cfg_args))
    assert [(fi.count, fi.loc_base) for fi in index.files] == [(40, -1), (5, -1), (7, 0), (4, 0)]
    assert index.files[3].path == str(jl)  # JSON lines in a .json file are read in place
    src = BlockSource(index)
    for f, name in enumerate((arr, gz, lines, jl)):
        got = src.rows([(f, i) for i in range(index.files[f].count)])
        want = [(r.loc if r.element is None else r.element, r.value) for r in read_rows(str(name))]
        assert [(loc, json.loads(raw)) for _, loc, raw in got] == want  # map's locations and values
    copies = {f.path: Path(f.path).stat().st_mtime_ns for f in index.files if f.path != f.name}
    assert len(copies) == 3
    other = index_stream(make_cfg(*cfg_args, "data.block_bytes=300"))  # another block size: the copies are reused
    assert [f.count for f in other.files] == [40, 5, 7, 4]
    assert {p: Path(p).stat().st_mtime_ns for p in copies} == copies


def test_broken_json_array_names_the_element(make_cfg, tmp_path):
    from dsrecipes.core.errors import DataError
    from dsrecipes.data.stream.index import index_stream

    bad = tmp_path / "bad.json"
    bad.write_text('[{"conversations": []},\n {"conversations": [}]', encoding="utf-8")
    cfg = make_cfg("data=iterable", f"dataset.paths=[{bad}]", f"data.cache_dir={tmp_path / 'c'}")
    broken = r"bad.json: unreadable at line 2, after 1 rows \(broken JSON: '}' closes '\['"
    with pytest.raises(DataError, match=broken):
        index_stream(cfg)
    skip = make_cfg("data=iterable", f"dataset.paths=[{bad}]", f"data.cache_dir={tmp_path / 'c'}",
                    "dataset.bad_rows=skip")
    with pytest.raises(DataError, match=broken):  # like data=map: its rows cannot be counted, so it is refused
        index_stream(skip)


def test_index_is_cached_by_content(make_cfg, tmp_path, monkeypatch):
    from dsrecipes.data.prepare import cache
    from dsrecipes.data.stream import files as stream_files
    from dsrecipes.data.stream.index import index_stream

    paths = write_corpus(tmp_path, [50, 60])
    cfg = make_cfg("data=iterable", f"dataset.paths=[{','.join(paths)}]", f"data.cache_dir={tmp_path / 'c'}")
    monkeypatch.setattr(cache, "RACY_SECONDS", float("-inf"))  # files just written are not memoised otherwise
    first = index_stream(cfg)
    fed = []
    monkeypatch.setattr(stream_files.LineScanner, "feed", lambda self, chunk: fed.append(len(chunk)))
    again = index_stream(cfg)
    assert not fed and [f.offsets.tolist() for f in again.files] == [f.offsets.tolist() for f in first.files]
    Path(paths[0]).write_text(Path(paths[0]).read_text() + '{"k": "new"}\n')
    monkeypatch.undo()
    assert index_stream(cfg).files[0].count == first.files[0].count + 1


def test_index_survives_the_run_directory(make_cfg, tmp_path):
    from dsrecipes.core.errors import DataError
    from dsrecipes.data.stream.index import build_stream_index, read_stream_index, write_stream_index

    paths = write_corpus(tmp_path, [30, 44])
    cfg = make_cfg("data=iterable", f"dataset.paths=[{','.join(paths)}]", f"data.cache_dir={tmp_path / 'c'}",
                   "dataset.val_size=5")
    index = build_stream_index(cfg)
    write_stream_index(tmp_path / "run", index)
    back = read_stream_index(tmp_path / "run")
    assert isinstance(back, StreamIndex) and back.holdout.tolist() == index.holdout.tolist()
    assert back.table().kept.tolist() == index.table().kept.tolist()
    back.verify()
    Path(paths[1]).write_text("{}\n")
    with pytest.raises(DataError, match="changed since the launching process indexed it"):
        back.verify()


def test_val_paths_are_the_validation_set(make_cfg, tmp_path):
    """dataset.val_paths: every row of those files is evaluated (tokenized like training rows), none is trained."""
    from dsrecipes.core.paths import SAMPLE_DATA_DIR
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    lines = (SAMPLE_DATA_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:60]) + "\n", encoding="utf-8")
    (tmp_path / "val.json").write_text(json.dumps([json.loads(x) for x in lines[60:71]]), encoding="utf-8")
    cfg = make_cfg("data=iterable", f"dataset.paths=[{tmp_path / 'train.jsonl'}]", f"dataset.val_paths=[{tmp_path / 'val.json'}]",
                   "dataset.val_size=5", f"data.cache_dir={tmp_path / 'c'}", "trainer.micro_batch_size=4")
    tok = load_tokenizer(cfg)
    plan = plan_like_launcher(cfg, tmp_path / "run", 2)
    val = [i for r in range(2) for b in build_loaders(cfg, tok, r, 2, tmp_path / "run", plan)[1] for i in b["ids"]]
    want = {json.loads(x).get("id") or f"val.json:{k}" for k, x in enumerate(lines[60:71])}
    assert sorted(val) == sorted(want)  # all 11 rows, none held out of the training files (val_size unused)
    train = build_loaders(cfg, tok, 0, 1, tmp_path / "run", plan)[0]
    assert train.planned == 60
    assert not {i for b in train for i in b["ids"]} & want


def test_a_validation_file_that_is_also_trained_on_is_refused(make_cfg, tmp_path, monkeypatch, capsys):
    """dataset.val_paths naming a training file under another spelling (relative, `./`, `../`, a link) is refused:
    its rows would be evaluated after being trained on. The same validation file twice is read once."""
    from dsrecipes.core.errors import DataError
    from dsrecipes.core.paths import SAMPLE_DATA_DIR
    from dsrecipes.data.stream.index import index_stream

    lines = (SAMPLE_DATA_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()
    (tmp_path / "d").mkdir()
    for name, part in (("train.jsonl", lines[:20]), ("val.jsonl", lines[20:26])):
        (tmp_path / "d" / name).write_text("\n".join(part) + "\n", encoding="utf-8")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "d" / "train.jsonl")
    (tmp_path / "e").mkdir()
    monkeypatch.chdir(tmp_path / "e")
    train = f"dataset.paths=[{tmp_path / 'd' / 'train.jsonl'}]"
    for spelling in ("../d/train.jsonl", "./../d/*.jsonl", str(tmp_path / "link.jsonl")):
        cfg = make_cfg("data=iterable", train, f"dataset.val_paths=['{spelling}']", f"data.cache_dir={tmp_path / 'c'}")
        with pytest.raises(DataError, match="is the same file as the training file .*train.jsonl; a validation file"):
            index_stream(cfg)
    cfg = make_cfg("data=iterable", train, f"dataset.val_paths=[../d/val.jsonl,{tmp_path / 'd' / 'val.jsonl'}]",
                   f"data.cache_dir={tmp_path / 'c'}")
    index = index_stream(cfg)
    assert [fi.count for fi in index.files] == [20, 6]
    assert "val.jsonl (dataset.val_paths) is the same file as ../d/val.jsonl; it is read once" in capsys.readouterr().err


def test_epochs_leave_no_open_files(tmp_path):
    """A rank without DataLoader workers reads every epoch in its own process: file descriptors are given back."""
    import os

    paths = write_corpus(tmp_path, [40, 30, 20])
    loader = make_loader(stream_index_like_launcher(paths, tmp_path / "run", 256), Layout(1, 2, 1, 0), 0)
    loader.collate_fn = lambda rows: {"ids": [i for r in rows for i in r["ids"]]}
    before = len(os.listdir("/proc/self/fd"))
    for epoch in range(4):
        loader.set_epoch(epoch)
        it = iter(loader)
        next(it)
        if epoch % 2:
            list(it)  # a whole epoch; the others are abandoned after one batch, as a step budget does
        del it
    assert len(os.listdir("/proc/self/fd")) <= before


def test_automatic_chunk_size_local_one_block_store_a_128th_within_one_block_and_1_mib():
    """Local files keep the finest order (one block per chunk); a store stream gets 1/128 of its bytes, a power of
    two, never under one block nor over 1 MiB - and nothing a resume may change (data.span_bytes) enters it."""
    from dsrecipes.data.stream.sizes import auto_block_bytes, auto_chunk_bytes, blocks_per_chunk, chunk_bytes_of

    mb = 1 << 20
    assert auto_chunk_bytes(8 * mb, auto_block_bytes(8 * mb), remote=False) == auto_block_bytes(8 * mb)
    block = auto_block_bytes(8 * mb, remote=True)
    assert (block, auto_chunk_bytes(8 * mb, block, remote=True)) == (4096, 64 * 1024)
    assert auto_chunk_bytes(100 * 1024, 4096, remote=True) == 4096  # 800 B wanted: one block
    assert auto_chunk_bytes(1 << 40, auto_block_bytes(1 << 40, remote=True), remote=True) == mb  # 1 TB: capped
    assert auto_chunk_bytes(3 * mb, 4096, remote=True) == 32 * 1024  # 24 KiB rounded up
    assert chunk_bytes_of(12345, 8 * mb, block, remote=True) == 12345 and blocks_per_chunk(12345, block) == 3
    assert blocks_per_chunk(100, block) == 1
