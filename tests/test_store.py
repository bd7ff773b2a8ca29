"""Data in an object store (issue 23), against a real S3-API server (moto's standalone server, `s3_server`):
listing and globs, identity by ETag (no content read), ranged reads of exactly the blocks asked for, an object
replaced during a run refused, throttling and connections dropped mid-range survived (a real faulty proxy), the
one-pass indexing of the launching process, hf:// through the local Hub cache offline, and the validation messages
for a store that cannot be asked."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from dsrecipes.core.errors import DataError

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"


def lines(n: int, start: int = 0) -> list[str]:
    return SAMPLE.read_text(encoding="utf-8").splitlines()[start:start + n]


@pytest.fixture(scope="module")
def bucket(s3_server):
    """s3://dsr-data: two JSONL files, a gzipped JSONL, a JSON array."""
    from dsrecipes.data.sources.remote import s3

    fs = s3()
    fs.mkdir("s3://dsr-data")
    fs.pipe("s3://dsr-data/chat/a.jsonl", ("\n".join(lines(30)) + "\n").encode())
    fs.pipe("s3://dsr-data/chat/b.jsonl", ("\n".join(lines(20, 30)) + "\n").encode())
    fs.pipe("s3://dsr-data/more/c.jsonl.gz", gzip.compress(("\n".join(lines(10, 50)) + "\n").encode()))
    rows = [json.loads(x) for x in lines(8, 60)]
    fs.pipe("s3://dsr-data/more/d.json", json.dumps(rows, indent=1).encode())
    return fs


def test_globs_list_sorted_objects_and_unknown_buckets_say_so(bucket):
    from dsrecipes.data.sources.files import expand_paths

    files, missing = expand_paths(["s3://dsr-data/chat/*.jsonl", "s3://dsr-data/more/*", "s3://dsr-data/none/*.jsonl"])
    assert files == ["s3://dsr-data/chat/a.jsonl", "s3://dsr-data/chat/b.jsonl", "s3://dsr-data/more/c.jsonl.gz",
                     "s3://dsr-data/more/d.json"]
    assert missing == ["s3://dsr-data/none/*.jsonl"]
    with pytest.raises(DataError, match="s3://no-such-bucket/x/\\*.jsonl: not found in the store"):
        expand_paths(["s3://no-such-bucket/x/*.jsonl"])
    for bad, why in [("s3://key:secret@dsr-data/a.jsonl", "must not carry credentials"),
                     ("gs://dsr-data/a.jsonl", "scheme gs:// is not read")]:
        with pytest.raises(DataError, match=why):
            expand_paths([bad])


def test_rows_of_every_format_read_from_the_store_as_from_local_files(bucket, tmp_path):
    from dsrecipes.data.sources.files import read_rows

    fs = bucket
    for url in ("s3://dsr-data/chat/a.jsonl", "s3://dsr-data/more/c.jsonl.gz", "s3://dsr-data/more/d.json"):
        local = tmp_path / url.rsplit("/", 1)[1]
        local.write_bytes(fs.cat_file(url))
        remote_rows = [(r.loc, r.element, r.value, r.error) for r in read_rows(url)]
        assert remote_rows == [(r.loc, r.element, r.value, r.error) for r in read_rows(str(local))]
        assert all(r[3] is None for r in remote_rows) and len(remote_rows) in (30, 10, 8)


def test_identity_is_the_etag_and_a_replaced_object_is_refused(bucket):
    from dsrecipes.data.sources.remote import ObjectChanged, RangeReader, identity

    fs = bucket
    url = "s3://dsr-data/swap/x.jsonl"
    fs.pipe(url, b'{"a": 1}\n{"a": 2}\n')
    digest = identity(url)
    assert digest == identity(url) and digest.startswith("s3-")
    reader = RangeReader(url, digest)
    assert reader.read(9, 17) == b'{"a": 2}'
    fs.pipe(url, b'{"b": 1}\n{"b": 2}\n')  # same size, new content: a new ETag
    assert identity(url) != digest
    with pytest.raises(ObjectChanged, match="changed in the store since the launching process indexed it"):
        reader.read(0, 8)
    with pytest.raises(ObjectChanged):
        RangeReader(url, digest).read(0, 8)


def test_ranks_refuse_an_object_replaced_after_the_launch_indexed_it(make_cfg, bucket, tmp_path):
    from dsrecipes.data.sources.remote import ObjectChanged
    from dsrecipes.data.stream.index import BlockSource, index_stream

    url = "s3://dsr-data/swap/y.jsonl"
    bucket.pipe(url, ("\n".join(lines(12)) + "\n").encode())
    cfg = make_cfg("data=iterable", f"dataset.paths=[{url}]", f"data.cache_dir={tmp_path}", "dataset.val_size=0",
                   "dataset.max_samples=null", "trainer.max_steps=2", check_files=False)
    index = index_stream(cfg)
    assert all(f.etag for f in index.files)  # pinned: ranks send If-Match, no HEAD per rank and object
    assert BlockSource(index).block(0)
    bucket.pipe(url, ("\n".join(lines(12, 1)) + "\n").encode())
    with pytest.raises(ObjectChanged, match=r"s3://dsr-data/swap/y.jsonl: the object changed in the store"):
        BlockSource(index).block(0)
    assert index_stream(cfg).files[0].digest != index.files[0].digest  # a new launch indexes the new version


# ---------------------------------------------------------------------------------------------------------------
# One pass: what the launching process reads to index, identify and pre-scan a stream, cold and warm


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def _corpus(n: int, pad: int = 0) -> bytes:
    """n ShareGPT rows (the bundled sample data repeated, each with its own id), plus `pad` bytes of an extra
    field that is read but not trained on (large rows: many bytes, few rows to tokenize)."""
    rows = [json.loads(x) for x in lines(400)]
    out = []
    for i in range(n):
        row = dict(rows[i % len(rows)])
        row["id"] = f"r{i}"
        if pad:
            row["pad"] = "x" * pad
        out.append(json.dumps(row, ensure_ascii=False))
    return ("\n".join(out) + "\n").encode()


def _prepare(make_cfg, paths: str, cache: Path, run: Path, env=None):
    from dsrecipes.data.stream.scan import prepare_stream

    cfg = make_cfg("data=iterable", f"dataset.paths={paths}", f"data.cache_dir={cache}", "dataset.max_samples=null",
                   "dataset.val_size=0", "trainer.max_steps=2", check_files=False)
    run.mkdir(parents=True, exist_ok=True)
    return prepare_stream(cfg, run)


@pytest.mark.slow
def test_local_stream_is_read_once_cold_and_not_at_all_warm(make_cfg, tmp_path):
    import time

    (tmp_path / "warmup.jsonl").write_bytes(_corpus(50))
    _prepare(make_cfg, f"[{tmp_path / 'warmup.jsonl'}]", tmp_path / "cache0", tmp_path / "run0")  # imports
    data = tmp_path / "data"
    data.mkdir()
    for k in range(2):
        (data / f"part{k}.jsonl").write_bytes(_corpus(250 if k == 0 else 150, pad=20000))  # ~8 MB
    corpus = sum(p.stat().st_size for p in data.iterdir())
    before = _rchar()
    rows, *_ = _prepare(make_cfg, f"[{data}/*.jsonl]", tmp_path / "fresh", tmp_path / "run-fresh")
    fresh = _rchar() - before  # files just written: their hashes are not memoised, yet no second pass
    assert corpus <= fresh < 1.05 * corpus + (1 << 20), (fresh, corpus)
    time.sleep(2.2)  # older than cache.RACY_SECONDS: their hashes may be memoised
    before = _rchar()
    rows, *_ = _prepare(make_cfg, f"[{data}/*.jsonl]", tmp_path / "cache", tmp_path / "run1")
    cold = _rchar() - before
    before = _rchar()
    rows_warm, *_ = _prepare(make_cfg, f"[{data}/*.jsonl]", tmp_path / "cache", tmp_path / "run2")
    warm = _rchar() - before
    print(f"local one pass: corpus {corpus} B, read fresh {fresh / corpus:.3f}x, cold {cold / corpus:.3f}x, "
          f"warm {warm / corpus:.4f}x")
    assert rows == rows_warm == 400
    # cold: every byte once (index, content hash and row pre-scan in one pass) plus the tokenizer's files
    assert corpus <= cold < 1.05 * corpus + (1 << 20), (cold, corpus)  # three passes (before) would be 3x
    assert warm < 1 << 20, (warm, corpus)  # warm: no content, only the tokenizer and metadata


def test_s3_stream_is_read_once_cold_and_not_at_all_warm(make_cfg, bucket, s3_server, tmp_path, monkeypatch):
    from tests.helpers.s3server import FaultProxy

    data = _corpus(1200)
    cut = data.index(b"\n", len(data) // 3) + 1
    bucket.pipe("s3://dsr-data/once/a.jsonl", data[:cut])
    bucket.pipe("s3://dsr-data/once/b.jsonl", data[cut:])
    proxy = FaultProxy(s3_server.port).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        rows, *_ = _prepare(make_cfg, "[s3://dsr-data/once/*.jsonl]", tmp_path / "cache", tmp_path / "run1")
        cold = proxy.body_bytes
        _prepare(make_cfg, "[s3://dsr-data/once/*.jsonl]", tmp_path / "cache", tmp_path / "run2")
        warm = proxy.body_bytes - cold
    finally:
        proxy.stop()
    print(f"s3 one pass: corpus {len(data)} B, body bytes cold {cold / len(data):.4f}x, warm {warm} B")
    assert rows == 1200
    assert len(data) <= cold < 1.01 * len(data) + (64 << 10), (cold, len(data))  # + listings and HEADs
    assert warm < 16 << 10, warm  # listings only: no object body is read again


# ---------------------------------------------------------------------------------------------------------------
# Faults: throttling (503 SlowDown) and connections dropped in the middle of a range, through a real proxy


def short_backoff(monkeypatch) -> None:
    """RangeReader's waits between attempts from 10 ms instead of 0.2 s (still doubling, the same attempts and
    deadline): these tests count attempts, retries and bytes, and the product's 0.2 s doubling to 8 s made the
    eight failed attempts of the fault that outlasts them ~21 s of sleeping."""
    from dsrecipes.data.sources import remote

    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


def test_readers_survive_throttling_and_dropped_connections_and_read_each_block_once(make_cfg, bucket, s3_server,
                                                                                      tmp_path, monkeypatch):
    from dsrecipes.data.stream.index import BlockSource, index_stream
    from tests.helpers.s3server import FaultProxy

    data = _corpus(600)
    bucket.pipe("s3://dsr-data/faults/a.jsonl", data)
    local = tmp_path / "a.jsonl"
    local.write_bytes(data)
    cfg = make_cfg("data=iterable", "dataset.paths=[s3://dsr-data/faults/a.jsonl]", f"data.cache_dir={tmp_path}",
                   "dataset.max_samples=null", "dataset.val_size=0", "data.block_bytes=16384", "trainer.max_steps=2",
                   check_files=False)
    index = index_stream(cfg)  # straight from the server
    proxy = FaultProxy(s3_server.port, slowdowns=3, drops=3).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    short_backoff(monkeypatch)
    try:
        source = BlockSource(index)
        got = [raw for g in range(index.blocks["count"].size) for _, _, raw in source.block(g)]
        retries = source._ranges.retries
        read = source.bytes_read
        source.close()
    finally:
        proxy.stop()
    assert got == [x for x in data.split(b"\n") if x]  # every row, in order, none twice, none torn
    assert read == len(data)  # each block once: the retried ranges are not counted twice
    assert proxy.slowdowns == 0 and proxy.drops == 0  # every fault was served (and survived)
    assert retries == 6  # one attempt each: RangeReader retries (and says so), botocore does not


def test_a_reader_with_prefetch_reads_its_stretch_exactly_once_through_faults(make_cfg, bucket, s3_server, tmp_path,
                                                                              monkeypatch):
    """The loader's own reader (window blocks prefetched by 16 threads) over a store that throttles and drops
    connections: 4 readers together read every sample once, and the corpus about once."""
    from dsrecipes.data.plan.epoch import Layout
    from dsrecipes.data.strategies.iterable import StreamTrainLoader
    from dsrecipes.data.stream.index import BlockSource, index_stream
    from tests.helpers.s3server import FaultProxy

    data = _corpus(800)
    bucket.pipe("s3://dsr-data/faults/c.jsonl", data)
    cfg = make_cfg("data=iterable", "dataset.paths=[s3://dsr-data/faults/c.jsonl]", f"data.cache_dir={tmp_path}",
                   "dataset.max_samples=null", "dataset.val_size=0", "data.block_bytes=8192", "trainer.max_steps=2",
                   check_files=False)
    index = index_stream(cfg)
    layout = Layout(4, 4, 1, 0)
    proxy = FaultProxy(s3_server.port, slowdowns=4, drops=4).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    ids, read = [], 0
    try:
        for rank in range(4):
            loader = StreamTrainLoader(index, layout, rank, seed=1, shuffle=True, shuffle_buffer=64, num_samples=None,
                                       make_rows=list, collate_fn=list, num_workers=0)
            source = BlockSource(index)
            ids += [json.loads(raw)["id"] for _, items in loader.reader(0, 0, 0, source) for _, _, raw, _ in items]
            read += source.bytes_read
            source.close()
    finally:
        proxy.stop()
    assert len(ids) == len(set(ids)) and 800 - len(ids) < 4 * 4  # exactly once; the remainder < one global batch
    assert len(data) <= read <= 1.05 * len(data) + 4 * 2 * 8192
    assert proxy.drops == 0 and proxy.slowdowns == 0


def test_a_fault_that_outlasts_the_stores_retries_is_retried_then_reported(bucket, s3_server, monkeypatch):
    from dsrecipes.data.sources.remote import RangeReader, identity
    from tests.helpers.s3server import FaultProxy

    url = "s3://dsr-data/faults/b.jsonl"
    bucket.pipe(url, b"0123456789" * 1000)
    digest = identity(url)
    proxy = FaultProxy(s3_server.port, drops=3).start()  # more than s3fs retries: RangeReader retries too
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    short_backoff(monkeypatch)  # the 8 attempts and the message are checked, not how long the waits are
    try:
        reader = RangeReader(url, digest)
        assert reader.read(5, 25) == b"56789012345678901234" and reader.retries >= 1  # (s3fs retries some)
        proxy.drops = 1000  # a store that keeps dropping: bounded, then one message naming object and endpoint
        with pytest.raises(DataError, match=r"s3://dsr-data/faults/b.jsonl: bytes 0-10 unreadable after 8 attempts "
                                            rf"in \d+ s from {proxy.endpoint} \(data.read_deadline_s=120\)"):
            RangeReader(url, digest).read(0, 10)
    finally:
        proxy.stop()


def test_a_store_that_fails_for_good_while_the_launch_indexes_is_one_message(make_cfg, bucket, s3_server, tmp_path,
                                                                            monkeypatch):
    """The launching side's index scan (data=iterable) reads whole objects: a fault that outlasts the retries is one
    DataError naming the object (exit 2), as the ranks' ranged reads are, not an OSError from inside s3fs."""
    from tests.helpers.s3server import FaultProxy

    bucket.pipe("s3://dsr-data/faults/idx.jsonl", _corpus(40))
    proxy = FaultProxy(s3_server.port, drops=1000).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        with pytest.raises(DataError, match=r"^s3://dsr-data/faults/idx.jsonl: "):
            _prepare(make_cfg, "[s3://dsr-data/faults/idx.jsonl]", tmp_path / "cache", tmp_path / "run")
    finally:
        proxy.stop()


# ---------------------------------------------------------------------------------------------------------------
# hf://datasets/...: offline, through the local Hub cache


def _hub_dataset(hf_home: Path, repo: str, files: dict, commit: str = "c0ffee" * 6 + "abcd") -> Path:
    """The layout huggingface_hub writes for a dataset repo: refs/main -> commit, snapshots/<commit>/<file> links
    to blobs/."""
    base = hf_home / "hub" / f"datasets--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    for rel, data in files.items():
        blob = base / "blobs" / f"blob{abs(hash(rel))}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = base / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    return base / "snapshots" / commit


def test_hf_dataset_urls_resolve_offline_through_the_hub_cache(make_cfg, tmp_path, monkeypatch):
    from dsrecipes.data.sources.files import expand_paths, read_rows
    from dsrecipes.data.stream.scan import prepare_stream

    gz = gzip.compress(("\n".join(lines(6, 10)) + "\n").encode())
    snapshot = _hub_dataset(tmp_path / "hf", "acme/chats", {"data/train-0.jsonl": ("\n".join(lines(10)) + "\n").encode(),
                                                             "data/train-1.jsonl.gz": gz, "README.md": b"# chats"})
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files, missing = expand_paths(["hf://datasets/acme/chats/data/train-*"])
    assert files == [str(snapshot / "data" / "train-0.jsonl"), str(snapshot / "data" / "train-1.jsonl.gz")]
    assert not missing and sum(1 for f in files for _ in read_rows(f)) == 16
    cfg = make_cfg("data=iterable", "dataset.paths=[hf://datasets/acme/chats/data/*.jsonl*]",
                   f"data.cache_dir={tmp_path / 'cache'}", "dataset.max_samples=null", "dataset.val_size=0",
                   "trainer.max_steps=2")
    assert prepare_stream(cfg, tmp_path / "run")[0] == 16
    with pytest.raises(DataError, match="HF_HUB_OFFLINE is set while the hub cache has no copy"):
        expand_paths(["hf://datasets/acme/not-cached/*.jsonl"])


def test_val_paths_and_registry_file_names_may_be_urls(make_cfg, bucket, tmp_path):
    from dsrecipes.data.sources.registry import resolve_sources
    from dsrecipes.data.stream.index import BlockSource, build_stream_index

    (tmp_path / "dataset_info.json").write_text(json.dumps(
        {"chats": {"file_name": "s3://dsr-data/chat/a.jsonl", "formatting": "sharegpt"}}), encoding="utf-8")
    cfg = make_cfg("data=iterable", "dataset.paths=[]", f"dataset.registry={tmp_path / 'dataset_info.json'}",
                   "dataset.use=[chats]", "dataset.val_paths=[s3://dsr-data/chat/b.jsonl]",
                   f"data.cache_dir={tmp_path / 'cache'}", "dataset.max_samples=null", "trainer.max_steps=2")
    assert resolve_sources(cfg.dataset)[0].paths == ["s3://dsr-data/chat/a.jsonl"]
    index = build_stream_index(cfg)
    assert [index.files[f].path for f in index.val_files] == ["s3://dsr-data/chat/b.jsonl"]
    assert index.num_lines == 30 and index.num_val == 20
    rows = BlockSource(index).rows(index.val_refs())
    assert [raw for _, _, raw in rows] == [x.encode() for x in lines(20, 30)]


# ---------------------------------------------------------------------------------------------------------------
# Read-ahead: a reader's blocks in few large ranged GETs (data/sources/remote_ahead.py), counted at a real proxy


def _ranged_proxy(port: int, drops: int = 0, drop_min: int = 0):
    """A FaultProxy that records the length of every ranged GET and drops (half-way through the body) only the
    first `drops` GETs of at least `drop_min` bytes: a connection lost in the middle of a coalesced range."""
    from tests.helpers.s3server import FaultProxy

    class Proxy(FaultProxy):
        def _fault(self, handler):
            rng = handler.headers.get("Range", "")
            if handler.command == "GET" and rng.startswith("bytes="):
                a, b = (int(x) for x in rng[6:].split("-"))
                with self.lock:
                    self.ranges.append(b - a + 1)
                    if self.big_drops and b - a + 1 >= drop_min:
                        self.big_drops -= 1
                        self.requests += 1
                        return "drop"
            return super()._fault(handler)

    proxy = Proxy(port)
    proxy.ranges, proxy.big_drops = [], drops
    return proxy.start()


def _stream_ids(index, readers: int, **source_kw):
    """Every reader of a world of `readers` run in turn (shuffle window 64): (sample ids, BlockSources' stats)."""
    from dsrecipes.data.plan.epoch import Layout
    from dsrecipes.data.strategies.iterable import StreamTrainLoader
    from dsrecipes.data.stream.index import BlockSource

    ids, stats = [], []
    for rank in range(readers):
        loader = StreamTrainLoader(index, Layout(readers, 4, 1, 0), rank, seed=3, shuffle=True, shuffle_buffer=64,
                                   num_samples=None, make_rows=list, collate_fn=list, num_workers=0)
        source = BlockSource(index, **source_kw)
        ids += [json.loads(raw)["id"] for _, items in loader.reader(0, 0, 0, source) for _, _, raw, _ in items]
        stats.append({"bytes": source.bytes_read, "gets": source.gets, "peak": source._ahead.peak,
                      "retries": source._ranges.retries})
        source.close()
    return ids, stats


@pytest.fixture(scope="module")
def ahead_corpus(bucket, tmp_path_factory):
    """1,000 rows in two objects, indexed in 2 KiB blocks (~270 blocks)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.stream.index import index_stream

    data = _corpus(1000)
    cut = data.index(b"\n", len(data) // 2) + 1
    bucket.pipe("s3://dsr-data/ahead/a.jsonl", data[:cut])
    bucket.pipe("s3://dsr-data/ahead/b.jsonl", data[cut:])
    cfg = compose_and_load(["data=iterable", "dataset.paths=[s3://dsr-data/ahead/*.jsonl]", "dataset.val_size=0",
                            f"data.cache_dir={tmp_path_factory.mktemp('ahead')}", "dataset.max_samples=null",
                            "data.block_bytes=2048", "trainer.max_steps=2"], check_files=False)
    return index_stream(cfg), len(data)


def test_read_ahead_fetches_a_readers_adjacent_blocks_in_few_gets_each_byte_once(ahead_corpus, s3_server,
                                                                               monkeypatch):
    index, corpus = ahead_corpus
    blocks = int(index.blocks["count"].size)
    proxy = _ranged_proxy(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        ids, [one] = _stream_ids(index, 1, span_bytes=64 << 10)
        gets_one, big = len(proxy.ranges), max(proxy.ranges)
        ids4, four = _stream_ids(index, 4, span_bytes=64 << 10)
        gets_four = len(proxy.ranges) - gets_one
    finally:
        proxy.stop()
    assert sorted(ids) == sorted(set(ids)) and 1000 - len(ids) < 4  # every sample once
    assert one["bytes"] == corpus and proxy.body_bytes >= corpus  # each byte once: spans never cover a gap
    # 4 single GETs first (the first micro-batch's blocks), then spans of adjacent blocks: not one GET per block
    assert one["gets"] == gets_one <= 2 * 4 + 2 + corpus // (60 << 10) < blocks // 8, (gets_one, blocks)
    assert 32 << 10 < big <= 64 << 10  # coalesced up to span_bytes
    assert sorted(ids4) == sorted(set(ids4)) and 1000 - len(ids4) < 16
    assert corpus <= sum(s["bytes"] for s in four) <= 1.05 * corpus  # R = 4: the corpus about once
    assert sum(s["gets"] for s in four) == gets_four < blocks + 4  # no block twice, none outside the read-ahead


def test_read_ahead_survives_a_connection_dropped_inside_a_coalesced_range(ahead_corpus, s3_server, monkeypatch):
    index, corpus = ahead_corpus
    proxy = _ranged_proxy(s3_server.port, drops=2, drop_min=32 << 10)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        ids, [one] = _stream_ids(index, 1, span_bytes=64 << 10)
    finally:
        proxy.stop()
    assert proxy.big_drops == 0  # two spans of >= 32 KiB were cut half-way and fetched again
    assert sorted(ids) == sorted(set(ids)) and 1000 - len(ids) < 4  # every row once, none torn
    assert one["bytes"] == corpus  # the retried spans count once


def test_read_ahead_memory_is_bounded_and_a_replaced_object_is_refused(ahead_corpus, bucket, s3_server, monkeypatch):
    from dsrecipes.data.sources.remote import ObjectChanged

    index, corpus = ahead_corpus
    biggest = int(max(np.diff(fi.offsets).max() for fi in index.files))
    ids, [one] = _stream_ids(index, 1, read_ahead_bytes=16 << 10, span_bytes=8 << 10)
    assert sorted(ids) == sorted(set(ids)) and 1000 - len(ids) < 4 and one["bytes"] == corpus
    assert 8 << 10 < one["peak"] <= (16 << 10) + biggest  # held ahead: the budget plus one block at most
    assert one["gets"] >= corpus // (8 << 10)  # spans of <= 8 KiB
    old = bucket.cat_file("s3://dsr-data/ahead/b.jsonl")
    bucket.pipe("s3://dsr-data/ahead/b.jsonl", old.replace(b'"r9', b'"R9'))  # same size, another ETag
    try:
        with pytest.raises(ObjectChanged, match="s3://dsr-data/ahead/b.jsonl: the object changed in the store"):
            _stream_ids(index, 1)
    finally:
        bucket.pipe("s3://dsr-data/ahead/b.jsonl", old)


def test_store_streams_read_in_chunks_each_block_once_in_fewer_gets(ahead_corpus, s3_server, tmp_path, monkeypatch):
    """Automatic chunks (stream bytes / 128): 8 readers together read each block once per epoch, in fewer ranged GETs
    than with data.chunk_bytes forced to one block (the order that scatters a reader's blocks over the objects)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.stream.index import index_stream

    auto, corpus = ahead_corpus
    assert auto.chunk_bytes == 1 << (corpus // 128 - 1).bit_length() > auto.block_bytes  # 4 KiB: 2 blocks
    assert auto.table().chunks.max() + 1 < auto.blocks["count"].size / 1.8
    one = index_stream(compose_and_load(["data=iterable", "dataset.paths=[s3://dsr-data/ahead/*.jsonl]",
                                         "dataset.val_size=0", f"data.cache_dir={tmp_path}", "dataset.max_samples=null",
                                         "data.block_bytes=2048", "data.chunk_bytes=2048", "trainer.max_steps=2"],
                                        check_files=False))
    assert one.chunk_bytes == 2048 and one.table().chunks.max() + 1 == one.blocks["count"].size
    proxy = _ranged_proxy(s3_server.port)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    gets = {}
    try:
        for name, index in (("chunks", auto), ("blocks", one)):
            ids, stats = _stream_ids(index, 8, span_bytes=64 << 10)
            assert sorted(ids) == sorted(set(ids)) and 1000 - len(ids) < 8 * 4  # every sample once
            assert corpus <= sum(s["bytes"] for s in stats) <= 1.05 * corpus, name  # each block once per epoch
            gets[name] = sum(s["gets"] for s in stats)
    finally:
        proxy.stop()
    print(f"8 readers: {gets['chunks']} GETs with chunks, {gets['blocks']} with one block per chunk")
    assert gets["chunks"] < 0.8 * gets["blocks"], gets
