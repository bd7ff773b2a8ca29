"""dsrecipes `data=iterable` vs mosaicml-streaming, both reading the same ShareGPT corpus from the same S3-API server.

    pip install mosaicml-streaming --no-deps   # (+ brotli python-snappy cramjam zstd catalogue; not a dsrecipes dep)
    python benchmarks/bench_store.py [--mb 32] [--files 8] [--readers 1 8 64] [--reps 3] [--shard-mb 2] [--chunk-kb K]

Starts moto's standalone S3 server on 127.0.0.1 and a counting HTTP proxy in front of it (tests/helpers/s3server.py;
both systems talk to the proxy, which counts the response body bytes it relays), writes a corpus of real ShareGPT
rows (the Glaive tool-call demo files of ../shared/data when present, else the bundled sample data, repeated with
fresh ids) as JSONL files into `s3://bench/jsonl/`, and the same rows as MDS shards (`MDSWriter`, one `text` column
holding the row's JSON, `size_limit` --shard-mb) into `s3://bench/mds/`. Then, per repetition, A and B alternate:

  launch   what the launching process reads and how long it takes before the first step. dsrecipes: the stream index
           (list, HEAD, one ranged pass per object; `data.prescan=false`, then again warm from its cache), and the
           same with the row pre-scan (`prescan`: tokenizer checks in the same pass). streaming: the dataset's
           index.json (its launch); the MDS conversion is a separate offline pass over the corpus (reported once).
  R readers (R ranks x 1 reader, each on its own node; run one after another in this process): bytes transferred
           per epoch and requests (at the proxy), time to first batch, samples/s per reader (median). Both systems are timed to the same point:
           from nothing in memory but the launch's products to MBS (4) *decoded rows* (`json.loads` of each row's
           JSON text) for the first batch, and to the end of the reader's epoch for samples/s. dsrecipes: the clock
           starts before the run directory's stream index is read and the loader and its BlockSource are built (what
           a rank does; `StreamTrainLoader.reader`: read-ahead of its own blocks, adjacent ones in one ranged GET). streaming: the clock starts before
           `StreamingDataset(remote, local)` (its index.json GET; shuffle on, batch_size 4, its own local cache, its
           default download threads and predownload); each sample's `text` decoded; node r of R is `RANK=r
           WORLD_SIZE=R LOCAL_WORLD_SIZE=1` (its process group is switched off: see `st_readers`). Both are run for
           real at every R: bytes, GETs and times are measured, none computed.

dsrecipes' epoch order keeps chunks of adjacent blocks together (`data.chunk_bytes`, automatic: the corpus / 128, so
a reader's blocks come in runs one GET serves); --chunk-kb sets it (the block size: the order from before chunks).

Ratios per repetition, oriented so that >= 1 means dsrecipes is no worse (first batch: streaming's time /
dsrecipes'; samples/s: dsrecipes' / streaming's); reported as median [min, max].
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.s3server import FaultProxy, S3Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent.parent / "shared" / "data"
MBS = 4


def rows_source() -> list:
    files = sorted(SHARED.glob("glaive_toolcall_*_demo.json")) if SHARED.is_dir() else []
    if files:
        return [r for f in files for r in json.loads(f.read_text(encoding="utf-8"))]
    sample = ROOT / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
    return [json.loads(x) for x in sample.read_text(encoding="utf-8").splitlines() if x.strip()]


def make_corpus(mb: float, files: int) -> list:
    """`files` lists of JSONL lines, `mb` MiB in all (uneven files)."""
    rnd, base = random.Random(0), rows_source()
    weights = [rnd.uniform(0.5, 1.5) for _ in range(files)]
    out, n = [], 0
    for w in weights:
        target, size, lines = int(mb * (1 << 20) * w / sum(weights)), 0, []
        while size < target:
            row = dict(base[n % len(base)], id=f"row{n}")
            n += 1
            line = json.dumps(row, ensure_ascii=False) + "\n"
            lines.append(line)
            size += len(line.encode())
        out.append(lines)
    return out


def upload(fs, corpus: list, shard_mb: float, tmp: Path) -> dict:
    from streaming import MDSWriter

    for f, lines in enumerate(corpus):
        fs.pipe_file(f"s3://bench/jsonl/part{f:02d}.jsonl", "".join(lines).encode())
    t0 = time.perf_counter()
    mds = tmp / "mds"
    with MDSWriter(out=str(mds), columns={"text": "str"}, size_limit=int(shard_mb * (1 << 20))) as writer:
        for lines in corpus:
            for line in lines:
                writer.write({"text": line.rstrip("\n")})
    convert_s = time.perf_counter() - t0
    for p in sorted(mds.iterdir()):
        fs.put_file(str(p), f"s3://bench/mds/{p.name}")
    shutil.rmtree(mds)
    return {"mds_convert_s": round(convert_s, 2), "mds_files": len(fs.ls("s3://bench/mds"))}


# ---------------------------------------------------------------------------------------------------------------
# dsrecipes


CHUNK = ["data.chunk_bytes=null"]  # --chunk-kb


def ds_cfg(cache: Path, prescan: bool):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(["data=iterable", "dataset.paths=[s3://bench/jsonl/*.jsonl]", f"data.cache_dir={cache}",
                             "dataset.val_size=0", "dataset.max_samples=null", f"data.prescan={str(prescan).lower()}",
                             "trainer.max_steps=1", *CHUNK], check_files=False)


def ds_launch(proxy, tmp: Path, prescan: bool) -> dict:
    """(cold, warm) bytes and seconds of the launching process: prepare_stream (index, optional pre-scan)."""
    from dsrecipes.data.stream.scan import prepare_stream

    cache, out = Path(tempfile.mkdtemp(dir=tmp)), {}
    for phase in ("cold", "warm"):
        run = Path(tempfile.mkdtemp(dir=tmp))
        b0, t0 = proxy.body_bytes, time.perf_counter()
        prepare_stream(ds_cfg(cache, prescan), run)
        out[phase] = (proxy.body_bytes - b0, time.perf_counter() - t0)
    return {"launch": out, "run": run}


def ds_readers(run: Path, readers: int, proxy) -> dict:
    """Every reader of R, one after another. Timed per reader from nothing in memory (the run directory's stream
    index read, the loader and its BlockSource built: what a rank does) to the first micro-batch of MBS decoded rows
    (`json.loads` of each raw line) and to the end of its stretch."""
    from dsrecipes.data.plan import Layout
    from dsrecipes.data.strategies.iterable import StreamTrainLoader
    from dsrecipes.data.stream.index import BlockSource, read_stream_index

    layout = Layout(readers, MBS, 1, 0)
    b0, r0, first, rates = proxy.body_bytes, proxy.requests, None, []
    for rank in range(readers):
        t0, n = time.perf_counter(), 0
        index = read_stream_index(run)
        loader = StreamTrainLoader(index, layout, rank, seed=0, shuffle=True, shuffle_buffer=1024, num_samples=None,
                                   make_rows=list, collate_fn=list, num_workers=0)
        source = BlockSource(index)
        for _, items in loader.reader(0, 0, 0, source):
            n += len([json.loads(raw) for _, _, raw, _ in items])
            if first is None:
                first = time.perf_counter() - t0
        rates.append(n / (time.perf_counter() - t0))
        source.close()
    return {"bytes": proxy.body_bytes - b0, "gets": proxy.requests - r0, "first_batch_s": first,
            "samples_s": statistics.median(rates), "block_bytes": index.block_bytes, "chunk_bytes": index.chunk_bytes}


# ---------------------------------------------------------------------------------------------------------------
# mosaicml-streaming


def import_streaming():
    for name in ("streaming.vision", "streaming.multimodal"):  # their torchvision imports are not needed here
        sys.modules.setdefault(name, types.ModuleType(name))
    import streaming

    return streaming


def st_dataset(local: Path, batch: int):
    from streaming import StreamingDataset

    return StreamingDataset(remote="s3://bench/mds", local=str(local), batch_size=batch, shuffle=True, shuffle_seed=0)


def st_launch(proxy, tmp: Path) -> dict:
    from streaming.base.util import clean_stale_shared_memory

    local = Path(tempfile.mkdtemp(dir=tmp))
    b0, t0 = proxy.body_bytes, time.perf_counter()
    ds = st_dataset(local, MBS)
    out = (proxy.body_bytes - b0, time.perf_counter() - t0)
    del ds
    clean_stale_shared_memory()
    return {"launch": {"cold": out}}


def st_readers(readers: int, proxy, tmp: Path) -> dict:
    """Every node of R (1 rank, 1 worker each), one after another in this process, like the dsrecipes readers:
    node r is `RANK=r WORLD_SIZE=R LOCAL_RANK=0 LOCAL_WORLD_SIZE=1`, each with its own local cache directory.
    streaming would start a torch process group for WORLD_SIZE > 1 only to pass a barrier at the end of
    `StreamingDataset.__init__` (no data crosses it; each node plans its own samples from the index and the world),
    so `maybe_init_dist` is switched off for the run (`no_process_group`)."""
    from streaming.base.util import clean_stale_shared_memory

    b0, r0, first, rates = proxy.body_bytes, proxy.requests, None, []
    with no_process_group():
        for node in range(readers):
            os.environ.update(RANK=str(node), WORLD_SIZE=str(readers), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            local = Path(tempfile.mkdtemp(dir=tmp))
            t0, n = time.perf_counter(), 0
            ds = st_dataset(local, MBS)  # timed like a dsrecipes reader: from nothing in memory (its index.json GET)
            for sample in ds:  # to MBS decoded rows: json.loads of the `text` column
                json.loads(sample["text"])
                n += 1
                if first is None and n == MBS:
                    first = time.perf_counter() - t0
            rates.append(n / (time.perf_counter() - t0))
            del ds
            clean_stale_shared_memory()
            shutil.rmtree(local, ignore_errors=True)
    return {"bytes": proxy.body_bytes - b0, "gets": proxy.requests - r0, "first_batch_s": first,
            "samples_s": statistics.median(rates)}


@contextmanager
def no_process_group():
    import streaming.base.dataset as st_dataset_module
    import streaming.base.util as st_util

    saved = st_dataset_module.maybe_init_dist, st_util.maybe_init_dist, dict(os.environ)
    st_dataset_module.maybe_init_dist = st_util.maybe_init_dist = lambda: False
    try:
        yield
    finally:
        st_dataset_module.maybe_init_dist, st_util.maybe_init_dist = saved[0], saved[1]
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
        os.environ.update(saved[2])


# ---------------------------------------------------------------------------------------------------------------


def spread(values: list) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=32)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shard-mb", type=float, default=2.0, help="MDS shard size_limit (streaming's default: 64)")
    ap.add_argument("--chunk-kb", type=float, default=None, help="dsrecipes' data.chunk_bytes in KiB (automatic)")
    args = ap.parse_args()
    if args.chunk_kb is not None:
        CHUNK[:] = [f"data.chunk_bytes={int(args.chunk_kb * 1024)}"]
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server and proxy on the way out
    import_streaming()
    server = S3Server().start()
    proxy = FaultProxy(server.port).start()
    env = server.env(proxy.endpoint)
    os.environ.update(env, S3_ENDPOINT_URL=proxy.endpoint, TOKENIZERS_PARALLELISM="false")
    tmp = Path(tempfile.mkdtemp(prefix="dsrecipes-bench-store-"))
    try:
        from dsrecipes.data.sources.remote import s3

        fs = s3()
        fs.mkdir("s3://bench")
        corpus = make_corpus(args.mb, args.files)
        total = sum(len("".join(lines).encode()) for lines in corpus)
        rows = sum(len(lines) for lines in corpus)
        info = upload(fs, corpus, args.shard_mb, tmp)
        print(json.dumps({"corpus_bytes": total, "rows": rows, "files": args.files, **info}), flush=True)
        results: dict = {"ds": [], "st": []}
        for rep in range(args.reps):
            order = ("ds", "st") if rep % 2 == 0 else ("st", "ds")  # A/B alternating
            for system in order:
                res = {}
                if system == "ds":
                    launch = ds_launch(proxy, tmp, prescan=False)
                    res["launch"] = launch["launch"]
                    if rep == 0:  # the pre-scan is tokenizer-bound, not store-bound: measured once
                        res["launch_prescan"] = ds_launch(proxy, tmp, prescan=True)["launch"]
                    for r in args.readers:
                        res[r] = ds_readers(launch["run"], r, proxy)
                else:
                    res["launch"] = st_launch(proxy, tmp)["launch"]
                    for r in args.readers:
                        res[r] = st_readers(r, proxy, tmp)
                results[system].append(res)
                print(json.dumps({"rep": rep, "system": system, **{str(k): v for k, v in res.items()}}), flush=True)
        report(results, total, args.readers)
    finally:
        proxy.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def report(results: dict, total: int, readers: list) -> None:
    ds, st = results["ds"], results["st"]
    print("\n| R | bytes/corpus: ds / st | GETs: ds / st | first batch s: ds / st (st/ds: >= 1 is ds no slower) | "
          "samples/s per reader: ds / st (ds/st: >= 1 is ds no slower) |")
    print("|---|---|---|---|---|")
    for r in readers:
        med = {key: [statistics.median([x[r][key] for x in runs]) for runs in (ds, st)]
               for key in ("bytes", "gets", "first_batch_s", "samples_s")}
        first = spread([b[r]["first_batch_s"] / a[r]["first_batch_s"] for a, b in zip(ds, st)])
        rate = spread([a[r]["samples_s"] / b[r]["samples_s"] for a, b in zip(ds, st)])
        print(f"| {r} | {med['bytes'][0] / total:.3f} / {med['bytes'][1] / total:.3f} | "
              f"{med['gets'][0]:.0f} / {med['gets'][1]:.0f} | {med['first_batch_s'][0]:.3f} / "
              f"{med['first_batch_s'][1]:.3f} ({first}) | {med['samples_s'][0]:.0f} / {med['samples_s'][1]:.0f} "
              f"({rate}) |")
    print("\n| launching process before the first step | bytes/corpus | seconds |")
    print("|---|---|---|")
    for name, rows in (("dsrecipes index, cold", [x["launch"]["cold"] for x in ds]),
                       ("dsrecipes index, warm", [x["launch"]["warm"] for x in ds]),
                       ("dsrecipes index + row pre-scan, cold (rep 0)", [ds[0]["launch_prescan"]["cold"]]),
                       ("dsrecipes index + row pre-scan, warm (rep 0)", [ds[0]["launch_prescan"]["warm"]]),
                       ("streaming (index.json)", [x["launch"]["cold"] for x in st])):
        print(f"| {name} | {spread([b / total for b, _ in rows])} | {spread([t for _, t in rows])} |")


if __name__ == "__main__":
    main()
