"""dsrecipes `data=iterable` vs mosaicml-streaming, both reading the same ShareGPT corpus from the same S3-API server.

    pip install mosaicml-streaming --no-deps   # (+ brotli python-snappy cramjam zstd catalogue; not a dsrecipes dep:
                                               #  best in a venv of its own made with --system-site-packages)
    python benchmarks/bench_store.py [--mb 256] [--files 8] [--readers 1 8 64] [--reps 3] [--shard-mb 2] [--chunk-kb K]
                                               [--st-predownload N] [--st-shuffle-block N]
    python benchmarks/bench_store.py --smoke   # 0.25 MiB, R = 1 and 2, 1 repetition: every phase in seconds

Starts moto's S3 server on 127.0.0.1 and a counting HTTP proxy in front of it, each in its own process, the server
reading only the range a ranged GET asks for, as S3 does (benchmarks/_store_server.py says why); both systems talk to
the proxy, which counts the response body bytes it relays. It generates the corpus (--mb MiB of deterministic synthetic
ShareGPT conversations, benchmarks/_sharegpt_corpus.py: nothing is read from outside the repository) as JSONL files into
`s3://bench/jsonl/`, and the same rows as MDS shards (`MDSWriter`, one `text` column holding the row's JSON,
`size_limit` --shard-mb) into `s3://bench/mds/`. Then, per repetition, A and B alternate:

  launch   what the launching process reads and how long it takes before the first step. dsrecipes: the stream index
           (list, HEAD, one ranged pass per object; `data.prescan=false`, then again warm from its cache), and the
           same with the row pre-scan (`prescan`: tokenizer checks in the same pass). streaming: the dataset's
           index.json (its launch); the MDS conversion is a separate offline pass over the corpus (reported once).
  R readers (R ranks x 1 reader, each on its own node; run one after another in this process): bytes transferred
           per epoch and requests (at the proxy), time to first batch, samples/s per reader (median). Both systems
           are timed to the same point: from nothing in memory but the launch's products to MBS (4) *decoded rows*
           (`json.loads` of each row's JSON text) for the first batch, and to the end of the reader's epoch for
           samples/s. Each reader of each system starts as a rank's DataLoader worker does: with no S3 client,
           connection or credential made before its clock starts. dsrecipes: the process's cached S3 client
           (`dsrecipes.data.sources.remote.s3()`, one per process) is dropped before the clock starts, so the reader
           builds its own inside its timed window (the count of distinct clients is checked and reported); the clock
           starts before the run directory's stream index is read and the loader and its BlockSource are built
           (`StreamTrainLoader.reader`: read-ahead of its own blocks, adjacent ones in one ranged GET). streaming:
           the clock starts before `StreamingDataset(remote, local)` (which builds its own client and GETs its
           index.json; shuffle on, batch_size 4, a fresh local cache, its default download threads and
           predownload: 8 x batch_size, or --st-predownload N); each sample's `text` decoded; node r of R is
           `RANK=r WORLD_SIZE=R LOCAL_WORLD_SIZE=1` (its process group is switched off: see `st_readers`). Both are
           run for real at every R: bytes, GETs and times are measured, none computed.

dsrecipes' epoch order keeps chunks of adjacent blocks together (`data.chunk_bytes`, automatic: the corpus / 128, so a
reader's blocks come in runs one GET serves); --chunk-kb sets it (the block size: the order from before chunks).

Ratios per repetition, oriented so that >= 1 means dsrecipes is no worse (first batch: streaming's time /
dsrecipes'; samples/s: dsrecipes' / streaming's); reported as median [min, max]. Where mosaicml-streaming cannot be
imported, the dsrecipes side still runs and the output and the result say that the streaming side was skipped and
why. Result: <out>/bench_store.json (every repetition, the summary, the notes) and <out>/README.md (what each system
was given, the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import Result, add_args  # (puts this checkout on sys.path: before dsrecipes and tests)
from _sharegpt_corpus import write_corpus
from _store_server import ProxyProcess, start_server
from _store_streaming import PREDOWNLOAD, SHUFFLE_BLOCK, import_streaming, st_launch, st_readers, upload_mds

MBS = 4


# ---------------------------------------------------------------------------------------------------------------
# dsrecipes

CHUNK = ["data.chunk_bytes=null"]  # --chunk-kb


def ds_cfg(cache: Path, prescan: bool):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(["data=iterable", "dataset.paths=[s3://bench/jsonl/*.jsonl]", f"data.cache_dir={cache}",
                             "dataset.val_size=0", "dataset.max_samples=null", f"data.prescan={str(prescan).lower()}",
                             "trainer.max_steps=1", *CHUNK], check_files=False)


CLIENT_CACHES = ("_S3", "_CLIENT")  # dsrecipes.data.sources.remote: s3fs file system, botocore client for ranged GETs


def client_caches() -> list:
    from dsrecipes.data.sources import remote

    missing = [name for name in CLIENT_CACHES if not isinstance(getattr(remote, name, None), dict)]
    if missing:
        raise SystemExit(f"dsrecipes.data.sources.remote has no client cache {missing}: update CLIENT_CACHES in "
                         "benchmarks/bench_store.py, or the readers would start with a warm client")
    return [getattr(remote, name) for name in CLIENT_CACHES]


def fresh_client() -> None:
    """Drop this process's cached dsrecipes S3 clients: the next read builds its own, as a fresh worker does."""
    for cache in client_caches():
        cache.clear()


def current_clients() -> list:
    return [c for cache in client_caches() for c in cache.values()]

def ds_launch(proxy, tmp: Path, prescan: bool) -> dict:
    """(cold, warm) bytes and seconds of the launching process: prepare_stream (index, optional pre-scan); each
    phase starts without an S3 client, as a launching process does."""
    from dsrecipes.data.stream.scan import prepare_stream

    cache, out = Path(tempfile.mkdtemp(dir=tmp)), {}
    for phase in ("cold", "warm"):
        run = Path(tempfile.mkdtemp(dir=tmp))
        fresh_client()
        b0, t0 = proxy.body_bytes, time.perf_counter()
        prepare_stream(ds_cfg(cache, prescan), run)
        out[phase] = (proxy.body_bytes - b0, time.perf_counter() - t0)
    return {"launch": out, "run": run}


def ds_readers(run: Path, readers: int, proxy) -> dict:
    """Every reader of R, one after another. Timed per reader from nothing in memory (no S3 client: the cached one is
    dropped before the clock starts; the run directory's stream index read, the loader and its BlockSource built:
    what a rank's worker does) to the first micro-batch of MBS decoded rows (`json.loads` of each raw line) and to
    the end of its stretch."""
    from dsrecipes.data.plan.epoch import Layout
    from dsrecipes.data.strategies.iterable import StreamTrainLoader
    from dsrecipes.data.stream.index import BlockSource, read_stream_index

    layout = Layout(readers, MBS, 1, 0)
    b0, r0, firsts, rates, built, previous = proxy.body_bytes, proxy.requests, [], [], 0, current_clients()
    for rank in range(readers):
        fresh_client()
        t0, n, first = time.perf_counter(), 0, None
        index = read_stream_index(run)
        loader = StreamTrainLoader(index, layout, rank, seed=0, shuffle=True, shuffle_buffer=1024, num_samples=None,
                                   make_rows=list, collate_fn=list, num_workers=0)
        source = BlockSource(index)
        for _, items in loader.reader(0, 0, 0, source):
            n += len([json.loads(raw) for _, _, raw, _ in items])
            if first is None:
                first = time.perf_counter() - t0
        rates.append(n / (time.perf_counter() - t0))
        firsts.append(first)
        clients = current_clients()  # `previous` are still referenced, so a new client cannot reuse their ids
        built += bool(clients) and not {id(c) for c in clients} & {id(c) for c in previous}
        previous = clients
        source.close()
    if built != readers:  # each reader must have built (and used) a client of its own
        raise SystemExit(f"dsrecipes R = {readers}: {built} S3 clients built for {readers} readers: the fresh-client "
                         "reset no longer reaches dsrecipes.data.sources.remote")
    return {"bytes": proxy.body_bytes - b0, "gets": proxy.requests - r0, "first_batch_s": statistics.median(firsts),
            "first_batch_s_range": [min(firsts), max(firsts)], "samples_s": statistics.median(rates),
            "block_bytes": index.block_bytes, "chunk_bytes": index.chunk_bytes, "clients_built": built}


def spread(values: list) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=256, help="corpus size in MiB (generated; >= 256 for real runs)")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shard-mb", type=float, default=2.0, help="MDS shard size_limit (streaming's default: 64)")
    ap.add_argument("--chunk-kb", type=float, default=None, help="dsrecipes' data.chunk_bytes in KiB (automatic)")
    ap.add_argument("--st-predownload", type=int, default=None, help="streaming's predownload (its default: 8 x MBS)")
    ap.add_argument("--st-shuffle-block", type=int, default=None,
                    help="streaming's shuffle_block_size in samples (its default: max(4M / nodes, 262144))")
    args = add_args(ap).parse_args()
    if args.smoke:
        args.mb, args.files, args.readers, args.reps, args.shard_mb = 0.25, 2, [1, 2], 1, 0.05
    return args


def streaming_or_why() -> str:
    """'' when mosaicml-streaming imports, else why not (ImportError, or one of its dependencies failing)."""
    try:
        return "" if import_streaming() else "?"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    args = parse_args()
    if args.chunk_kb is not None:
        CHUNK[:] = [f"data.chunk_bytes={int(args.chunk_kb * 1024)}"]
    PREDOWNLOAD[0], SHUFFLE_BLOCK[0] = args.st_predownload, args.st_shuffle_block
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server and proxy on the way out
    with Result("bench_store", args) as result:
        why = streaming_or_why()
        if why:
            result.note(f"streaming side SKIPPED: mosaicml-streaming cannot be imported ({why}); only dsrecipes is "
                        "measured, no comparison is made (install it with `pip install mosaicml-streaming --no-deps` "
                        "and brotli python-snappy cramjam zstd catalogue, e.g. in a venv with --system-site-packages)")
        elif args.shard_mb != 64:
            result.note(f"streaming's MDS shards are <= {args.shard_mb} MiB, not MDSWriter's default 64 MiB (--shard-mb"
                        " 64): fewer bytes, earlier first batch for it at R > 1; more GETs, fewer samples/s at R = 1")
        if not why and args.st_predownload is None:
            result.note(f"streaming's predownload is its default, 8 x batch_size = {8 * MBS} samples: its yield loop "
                        "sleeps 7 ms (streaming's TICK) whenever its ready thread, at most that far ahead, has not "
                        "caught up, which bounds its samples/s per reader flat out, not in training (a step takes "
                        f"{MBS}); --st-predownload N for streaming without that bound")
        if not why and args.st_shuffle_block is None:
            result.note("streaming shuffles as its default does (py1e over blocks of max(4M / nodes, 262144) samples: "
                        "one block holds the whole corpus below ~262k rows, so its order draws on many shards at "
                        "once); dsrecipes shuffles locally (its epoch order of chunks of adjacent blocks, then a "
                        "1024-sample buffer): samples/s (and at R > 1 possibly bytes) compare a far stronger shuffle "
                        "with a weaker one; --st-shuffle-block N for a more local one")
        server = start_server()  # moto, ranged GETs reading their range, in a process of its own
        proxy = ProxyProcess(server.port)  # the counting proxy, in a process of its own
        os.environ.update(server.env(proxy.endpoint), S3_ENDPOINT_URL=proxy.endpoint, TOKENIZERS_PARALLELISM="false")
        tmp = Path(tempfile.mkdtemp(prefix="dsrecipes-bench-store-"))
        try:
            run(args, result, proxy, tmp, systems=("ds",) if why else ("ds", "st"))
        finally:
            proxy.stop()
            server.stop()
            shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, result: Result, proxy, tmp: Path, systems: tuple) -> None:
    from dsrecipes.data.sources.remote import s3

    fs = s3()
    fs.mkdir("s3://bench")
    t0 = time.perf_counter()
    paths = write_corpus(tmp / "corpus", args.mb, args.files)
    corpus = {"corpus_bytes": sum(p.stat().st_size for p in paths), "generate_s": round(time.perf_counter() - t0, 2),
              "rows": sum(1 for p in paths for _ in open(p, "rb")), "files": args.files, "mb_asked": args.mb}
    for path in paths:
        fs.put_file(str(path), f"s3://bench/jsonl/{path.name}")
    if "st" in systems:
        corpus.update(upload_mds(fs, paths, args.shard_mb, tmp))
    shutil.rmtree(tmp / "corpus")
    result.extra["corpus"] = corpus
    print(json.dumps(corpus), flush=True)
    results: dict = {"ds": [], "st": []}
    loads = result.extra["loadavg"] = []
    for rep in range(args.reps):
        loads.append(round(os.getloadavg()[0], 1))
        for system in systems if rep % 2 == 0 else systems[::-1]:  # A/B alternating
            res = measure(system, rep, args, proxy, tmp)
            results[system].append(res)
            result.row({"rep": rep, "system": system, **{str(k): v for k, v in res.items()}})
    loads.append(round(os.getloadavg()[0], 1))
    result.extra["summary"] = report(results, corpus["corpus_bytes"], args.readers, loads)
    write_readme(result, args, corpus, systems)


def measure(system: str, rep: int, args: argparse.Namespace, proxy, tmp: Path) -> dict:
    if system == "st":
        return {"launch": st_launch(proxy, tmp, MBS)["launch"],
                **{r: st_readers(r, proxy, tmp, MBS) for r in args.readers}}
    launch = ds_launch(proxy, tmp, prescan=False)
    res: dict = {"launch": launch["launch"]}
    if rep == 0:  # the pre-scan is tokenizer-bound, not store-bound: measured once
        res["launch_prescan"] = ds_launch(proxy, tmp, prescan=True)["launch"]
    for r in args.readers:
        res[r] = ds_readers(launch["run"], r, proxy)
    return res


def report(results: dict, total: int, readers: list, loads: list) -> list:
    """Print the tables (markdown); return their lines."""
    ds, st = results["ds"], results["st"]
    lines = ["| R | bytes/corpus: ds / st | GETs: ds / st | first batch s, median over readers: ds / st (st/ds: >= 1 "
             "is ds no slower) | samples/s per reader: ds / st (ds/st: >= 1 is ds no slower) |", "|---|---|---|---|---|"]
    for r in readers:
        med = {key: [statistics.median([x[r][key] for x in runs]) if runs else float("nan") for runs in (ds, st)]
               for key in ("bytes", "gets", "first_batch_s", "samples_s")}
        first = spread([b[r]["first_batch_s"] / a[r]["first_batch_s"] for a, b in zip(ds, st)]) if st else "-"
        rate = spread([a[r]["samples_s"] / b[r]["samples_s"] for a, b in zip(ds, st)]) if st else "-"
        lines.append(f"| {r} | {med['bytes'][0] / total:.3f} / {med['bytes'][1] / total:.3f} | "
                     f"{med['gets'][0]:.0f} / {med['gets'][1]:.0f} | {med['first_batch_s'][0]:.3f} / "
                     f"{med['first_batch_s'][1]:.3f} ({first}) | {med['samples_s'][0]:.0f} / "
                     f"{med['samples_s'][1]:.0f} ({rate}) |")
    lines += ["", f"Load average (1 min) at each repetition's start and at the end: {loads}", "", "| launching process before the first step | bytes/corpus | seconds |", "|---|---|---|"]
    for name, rows in (("dsrecipes index, cold", [x["launch"]["cold"] for x in ds]),
                       ("dsrecipes index, warm", [x["launch"]["warm"] for x in ds]),
                       ("dsrecipes index + row pre-scan, cold (rep 0)", [ds[0]["launch_prescan"]["cold"]]),
                       ("dsrecipes index + row pre-scan, warm (rep 0)", [ds[0]["launch_prescan"]["warm"]]),
                       ("streaming (index.json)", [x["launch"]["cold"] for x in st])):
        if rows:
            lines.append(f"| {name} | {spread([b / total for b, _ in rows])} | {spread([t for _, t in rows])} |")
    print("\n" + "\n".join(lines), flush=True)
    return lines


def write_readme(result: Result, args: argparse.Namespace, corpus: dict, systems: tuple) -> None:
    given = [
        f"# bench_store: dsrecipes data=iterable vs mosaicml-streaming{' (SMOKE: numbers mean nothing)' if args.smoke else ''}",
        "", f"Command: `{sys.executable} {' '.join(sys.argv)}`", "",
        f"Corpus: {corpus['corpus_bytes']:,} bytes, {corpus['rows']:,} rows in {corpus['files']} JSONL files, generated "
        "by benchmarks/_sharegpt_corpus.py (deterministic synthetic ShareGPT conversations, seed 0); both systems "
        "read it through the same moto server and counting proxy on 127.0.0.1, each in a process of its own, the "
        "server reading only the asked range of a ranged GET, as S3 does (benchmarks/_store_server.py).", "",
        f"The machine ({os.cpu_count()} cores) also runs other jobs: compare the ratios, measured in the same repetition.", "",
        "What each system was given:",
        "- dsrecipes: the JSONL objects at s3://bench/jsonl/ (`data=iterable`, `data.prescan=false`, "
        f"`{CHUNK[0]}`), the run directory's stream index from the launch; each reader (R ranks x 1 reader, no "
        "DataLoader workers, one after another in one process) starts with no S3 client: the process's cached one is "
        "dropped before its clock starts, so it builds its own client and connections inside its timed window; "
        f"shuffle buffer 1024, micro-batch {MBS}.",
    ]
    if "st" in systems:
        given.append(f"- mosaicml-streaming: the same rows as MDS shards of <= {args.shard_mb} MiB at s3://bench/mds/ "
                     f"({corpus.get('mds_files')} files, one `text` column holding the row's JSON; conversion "
                     f"{corpus.get('mds_convert_s')} s offline, not timed), `StreamingDataset(remote, fresh local "
                     f"dir, batch_size={MBS}, shuffle=True, shuffle_seed=0)`, its default download threads, "
                     f"predownload {args.st_predownload or f'8 x {MBS} (its default)'}, shuffle_block_size "
                     f"{args.st_shuffle_block or 'max(4M / nodes, 262144) samples (its default)'}; node r of R is RANK=r "
                     "WORLD_SIZE=R LOCAL_WORLD_SIZE=1 with its process group switched off; each node builds its own "
                     "client inside its timed window.")
    else:
        given.append("- mosaicml-streaming: NOT RUN (see the notes).")
    given += ["", "Both are timed from nothing in memory but the launch's products to the first micro-batch of decoded "
              "rows (median over the readers of R) and to the end of each reader's epoch (samples/s per reader, "
              "median over the readers).", "", "Notes:", *[f"- {n}" for n in result.notes], "",
              *result.extra["summary"], ""]
    (result.out / "README.md").write_text("\n".join(given), encoding="utf-8")


if __name__ == "__main__":
    main()
