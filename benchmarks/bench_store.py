"""dsrecipes `data=iterable` vs mosaicml-streaming, both reading the same ShareGPT corpus from the same S3-API server.

    pip install mosaicml-streaming --no-deps   # (+ brotli python-snappy cramjam zstd catalogue; not a dsrecipes dep)
    python benchmarks/bench_store.py [--mb 32] [--files 8] [--readers 1 8 64] [--reps 3] [--shard-mb 2]

Starts moto's standalone S3 server on 127.0.0.1 and a counting HTTP proxy in front of it (tests/helpers/s3server.py;
both systems talk to the proxy, which counts the response body bytes it relays), writes a corpus of real ShareGPT
rows (the Glaive tool-call demo files of ../shared/data when present, else the bundled sample data, repeated with
fresh ids) as JSONL files into `s3://bench/jsonl/`, and the same rows as MDS shards (`MDSWriter`, one `text` column
holding the row's JSON, `size_limit` --shard-mb) into `s3://bench/mds/`. Then, per repetition, A and B alternate:

  launch   what the launching process reads and how long it takes before the first step. dsrecipes: the stream index
           (list, HEAD, one ranged pass per object; `data.prescan=false`, then again warm from its cache), and the
           same with the row pre-scan (`prescan`: tokenizer checks in the same pass). streaming: the dataset's
           index.json (its launch); the MDS conversion is a separate offline pass over the corpus (reported once).
  R readers (R ranks x 1 reader, each on its own node): bytes transferred per epoch, time to first batch
           (micro batch 4), samples/s per reader (median). dsrecipes: every reader run, one after another in this
           process (`StreamTrainLoader.reader` over a `BlockSource`: ranged GETs of its own blocks). streaming:
           R = 1 run for real (`StreamingDataset`, shuffle on, batch_size 4, its own local cache); for R > 1 it
           needs a real process group, so its bytes per epoch are computed from its own plan (`generate_work` for
           R nodes; each node downloads the shards its samples touch, whole) and its times are not measured.

Ratios are dsrecipes / streaming per repetition; reported as median [min, max].
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


def ds_cfg(cache: Path, prescan: bool):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(["data=iterable", "dataset.paths=[s3://bench/jsonl/*.jsonl]", f"data.cache_dir={cache}",
                             "dataset.val_size=0", "dataset.max_samples=null", f"data.prescan={str(prescan).lower()}",
                             "trainer.max_steps=1"], check_files=False)


def ds_launch(proxy, tmp: Path, prescan: bool) -> dict:
    """(cold, warm) bytes and seconds of the launching process: prepare_stream (index, optional pre-scan)."""
    from dsrecipes.data.stream.scan import prepare_stream

    cache, out = Path(tempfile.mkdtemp(dir=tmp)), {}
    for phase in ("cold", "warm"):
        run = Path(tempfile.mkdtemp(dir=tmp))
        b0, t0 = proxy.body_bytes, time.perf_counter()
        prepare_stream(ds_cfg(cache, prescan), run)
        out[phase] = (proxy.body_bytes - b0, time.perf_counter() - t0)
    from dsrecipes.data.stream.index import read_stream_index

    return {"launch": out, "index": read_stream_index(run)}


def ds_readers(index, readers: int, proxy) -> dict:
    from dsrecipes.data.plan import Layout
    from dsrecipes.data.strategies.iterable import StreamTrainLoader
    from dsrecipes.data.stream.index import BlockSource

    layout = Layout(readers, MBS, 1, 0)
    b0, first, rates = proxy.body_bytes, None, []
    for rank in range(readers):
        loader = StreamTrainLoader(index, layout, rank, seed=0, shuffle=True, shuffle_buffer=1024, num_samples=None,
                                   make_rows=list, collate_fn=list, num_workers=0)
        source = BlockSource(index)
        t0, n = time.perf_counter(), 0
        for _, items in loader.reader(0, 0, 0, source):
            if first is None:
                first = time.perf_counter() - t0
            n += len(items)
        rates.append(n / (time.perf_counter() - t0))
        source.close()
    return {"bytes": proxy.body_bytes - b0, "first_batch_s": first, "samples_s": statistics.median(rates)}


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
    """R = 1: one real reader (measured). R > 1: streaming cannot run several ranks in one process (it starts a
    process group), so the bytes of an epoch are computed from its own plan: `generate_work` for R nodes x 1 rank,
    and each node downloads every shard its samples touch, whole (no ranged reads)."""
    from streaming.base.batching import generate_work
    from streaming.base.util import clean_stale_shared_memory
    from streaming.base.world import World

    local = Path(tempfile.mkdtemp(dir=tmp))
    b0, t0, n, first = proxy.body_bytes, time.perf_counter(), 0, None
    ds = st_dataset(local, MBS)
    if readers == 1:
        for _ in ds:
            n += 1
            if first is None and n == MBS:
                first = time.perf_counter() - t0
        out = {"bytes": proxy.body_bytes - b0, "first_batch_s": first, "samples_s": n / (time.perf_counter() - t0)}
    else:
        world = World(num_nodes=readers, ranks_per_node=1, workers_per_rank=1, worker=0)
        ds.num_canonical_nodes = readers  # its default for the default shuffle (py1e): the physical nodes
        ds._set_shuffle_block_size(world)
        work = generate_work("random", ds, world, 0, 0)  # (nodes, ranks, workers, batches, batch)
        sizes = [shard.get_raw_size() for shard in ds.shards]
        total = 0
        for node in range(readers):
            ids = work[node].ravel()
            shards = {int(ds.spanner[int(i)][0]) for i in ids[ids >= 0]}
            total += sum(sizes[k] for k in shards)
        out = {"bytes": total, "first_batch_s": None, "samples_s": None, "computed": True}
    del ds
    clean_stale_shared_memory()
    shutil.rmtree(local, ignore_errors=True)
    return out


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
    args = ap.parse_args()
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
                        res[r] = ds_readers(launch["index"], r, proxy)
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
    print("\n| R | dsrecipes bytes/corpus | streaming bytes/corpus | first batch s: ds / st (ratio) | "
          "samples/s per reader: ds / st (ratio) |")
    print("|---|---|---|---|---|")
    for r in readers:
        db = [x[r]["bytes"] / total for x in ds]
        sb = [x[r]["bytes"] / total for x in st]
        df, sf = [x[r]["first_batch_s"] for x in ds], [x[r]["first_batch_s"] for x in st]
        dr, sr = [x[r]["samples_s"] for x in ds], [x[r]["samples_s"] for x in st]
        note = " (computed from its plan)" if st[0][r].get("computed") else ""
        if None in sf:
            print(f"| {r} | {spread(db)} | {spread(sb)}{note} | {statistics.median(df):.3f} / n/a | "
                  f"{statistics.median(dr):.0f} / n/a |")
            continue
        print(f"| {r} | {spread(db)} | {spread(sb)} | {statistics.median(df):.3f} / {statistics.median(sf):.3f} "
              f"({spread([a / b for a, b in zip(df, sf)])}) | {statistics.median(dr):.0f} / {statistics.median(sr):.0f}"
              f" ({spread([a / b for a, b in zip(dr, sr)])}) |")
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
