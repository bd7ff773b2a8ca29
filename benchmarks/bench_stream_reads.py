"""Bytes read by `data=iterable` readers: the old shared-stream filter vs block reading (issue 13).

    python benchmarks/bench_stream_reads.py [--gb 0.5] [--files 16] [--readers 1 8 64 256] [--workers 4]
                                            [--old-full 8] [--old-sample 2] [--dir /tmp/dsrecipes-bench-stream]
                                            [--chunk-kb 128 ...] [--order-only] [--out DIR]
    python benchmarks/bench_stream_reads.py --smoke     # 2 MiB in 4 files, R = 1 and 8, one chunk size: seconds

Writes a multi-file JSONL corpus (uneven files, lines of 0.2-2.5 KB from the bundled sample data), then simulates R
readers (R/W ranks x W DataLoader workers; R=1: one rank, no workers) over one epoch without training: every reader
runs the loader's own reading code and counts the bytes it reads.

  new: `StreamTrainLoader.reader` (block order, own stretch; stream/reader.py) over a `BlockSource` counting bytes;
  old: `sampler.select_slots` over every line of every file (the pre-issue-13 iterable reader; still the presharded
       reader); every old reader reads the whole stream by construction, so for R > --old-full only --old-sample
       readers are run and the total is R x their mean (stated in the output).

Reported per R: total bytes read / corpus bytes for both, the bound of the new scheme (corpus + 2 blocks per reader),
median per-reader throughput (MB/s of bytes read, samples/s of own samples; one run of each scheme per R, new
first for the 1st, 3rd, ... R and old first for the others: single runs, so compare bytes, not a small MB/s gap).
Also: index build time per GB (cold: hash + line scan in one pass; warm: cache hit), and how random each order is (mean distinct 1024-line regions per
global batch; mean |Spearman| of a file's samples: training step vs line order, 1 = file order kept); with
--chunk-kb, also of the order with `data.chunk_bytes` of these sizes (the local default is one block per chunk).
The corpus is generated from the bundled sample rows into --dir (--smoke: into the result directory). Result file:
<out>/bench_stream_reads.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _harness import Result, add_args  # (puts this checkout on sys.path: before dsrecipes)

from dsrecipes.data.plan.epoch import EpochPlan, Layout, StreamShuffle, file_order
from dsrecipes.data.plan.sampler import iter_items, select_slots
from dsrecipes.data.stream.sizes import blocks_per_chunk

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
MBS = 4


def make_corpus(root: Path, gb: float, files: int) -> list:
    marker = root / f"corpus-{gb}-{files}.json"
    if marker.is_file():
        return json.loads(marker.read_text())
    root.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    base = [json.loads(x) for x in SAMPLE.read_text(encoding="utf-8").splitlines()]
    weights = [rnd.uniform(0.2, 1.8) for _ in range(files)]
    paths = []
    for f, w in enumerate(weights):
        target = int(gb * (1 << 30) * w / sum(weights))
        path, size, lines = root / f"shard{f:03d}.jsonl", 0, []
        with open(path, "w", encoding="utf-8") as fh:
            while size < target:
                row = dict(rnd.choice(base), pad="x" * rnd.randint(0, 2000))
                line = json.dumps(row, ensure_ascii=False) + "\n"
                lines.append(line)
                size += len(line.encode("utf-8"))
                if len(lines) >= 4096:
                    fh.write("".join(lines))
                    lines = []
            fh.write("".join(lines))
        paths.append(str(path))
    marker.write_text(json.dumps(paths))
    return paths


def layout_for(readers: int, workers: int) -> Layout:
    if readers == 1:
        return Layout(1, MBS, 1, 0)
    return Layout(readers // workers, MBS, 1, workers)


def index_times(paths: list) -> tuple:
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.stream.index import build_stream_index

    cache = tempfile.mkdtemp(prefix="dsrecipes-bench-cache-")
    cfg = compose_and_load(["data=iterable", f"dataset.paths=[{','.join(paths)}]", f"data.cache_dir={cache}",
                            "dataset.val_size=0", "dataset.max_samples=null"], check_files=False)
    t0 = time.perf_counter()
    index = build_stream_index(cfg)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_stream_index(cfg)
    return index, cold, time.perf_counter() - t0


def run_new(index, layout: Layout) -> dict:
    from dsrecipes.data.strategies.iterable import StreamTrainLoader
    from dsrecipes.data.stream.index import BlockSource

    stats = []
    for rank in range(layout.world_size):
        loader = StreamTrainLoader(index, layout, rank, seed=0, shuffle=True, shuffle_buffer=1024, num_samples=None,
                                   make_rows=list, collate_fn=list, num_workers=layout.num_workers)
        for w in range(layout.readers_per_rank):
            source = BlockSource(index)
            t0, n = time.perf_counter(), 0
            for _, items in loader.reader(w, 0, 0, source):
                n += len(items)
            stats.append((source.bytes_read, n, time.perf_counter() - t0))
            source.close()
    return summarize(stats, len(stats))


def run_old(paths: list, counts: list, layout: Layout, limit: int) -> dict:
    """Readers of the old scheme; every one walks every line (bytes counted from the lines it iterates)."""
    total = sum(counts)
    plan = EpochPlan(total, layout)
    order = file_order(len(paths), 0, 0, True)
    shuffle = StreamShuffle(0, 0, 1024)
    stats = []
    readers = [(r, w) for r in range(layout.world_size) for w in range(layout.readers_per_rank)]
    for rank, w in readers[:: max(1, len(readers) // limit)][:limit]:
        seen = [0]

        def items():
            for item in iter_items(paths, order):
                seen[0] += len(item[2])
                yield item

        t0, n = time.perf_counter(), 0
        for _, batch in select_slots(items(), shuffle, layout, rank, w, steps=plan.steps):
            n += len(batch)
        stats.append((seen[0], n, time.perf_counter() - t0))  # the corpus has no blank lines: all bytes
    return summarize(stats, len(readers))


def both_schemes(i: int, new, old) -> tuple:
    """(new(), old()), run in that order for the 1st, 3rd, ... R and in the other for the 2nd, 4th, ...: a drift of
    the machine's load (its throughput columns) falls on both schemes alike. Their bytes do not depend on it."""
    if i % 2 == 0:
        first = new()
        return first, old()
    first = old()
    return new(), first


def summarize(stats: list, readers: int) -> dict:
    measured = len(stats)
    mean_bytes = statistics.mean(b for b, _, _ in stats)
    return {"readers": readers, "measured": measured, "bytes": mean_bytes * readers if measured < readers
            else sum(b for b, _, _ in stats), "mb_s": statistics.median(b / t / 1e6 for b, _, t in stats),
            "samples_s": statistics.median(n / t for _, n, t in stats)}


def order_quality(index, counts: list, layout: Layout) -> dict:
    """Both orders from their plans (no reading): regions per global batch, file order kept (|Spearman|)."""
    from dsrecipes.data.strategies.audit import _sample_numbers, block_reads
    from dsrecipes.data.stream.order import epoch_visits
    from dsrecipes.data.stream.segments import LocalShuffle, epoch_segment

    table, total = index.table(), sum(counts)
    sh = LocalShuffle(0, 0, 1024, True)
    sample_at, _ = _sample_numbers(table, epoch_visits(table, 0, 0, True), 0, 0, True)
    new = np.full(total, -1)
    for _, _, micros, samples in block_reads(epoch_segment(total, (), layout, sh), sh, sample_at):
        new[samples.ravel()] = np.repeat(micros // layout.grad_accum, MBS)  # identity order == natural order
    item_sample = np.concatenate([np.arange(counts[f]) + sum(counts[:f]) for f in file_order(len(counts), 0, 0, True)])
    plan = EpochPlan(total, layout)
    pos = StreamShuffle(0, 0, 1024).full_order(total)
    old = np.full(total, -1)
    ok = pos < plan.end
    old[item_sample[ok]] = plan.owner(pos[ok])[1] // layout.grad_accum
    return {"new": _quality(new, counts), "old": _quality(old, counts)}


def _quality(step: np.ndarray, counts: list) -> dict:
    read = step >= 0
    regions = [len(np.unique(np.flatnonzero(step == s) // 1024)) for s in range(0, int(step.max()) + 1,
                                                                                max(1, int(step.max()) // 200))]
    rhos, start = [], 0
    for n in counts:
        s = step[start:start + n][read[start:start + n]]
        if s.size > 2:
            rhos.append(abs(float(np.corrcoef(np.argsort(np.argsort(s)), np.arange(s.size))[0, 1])))
        start += n
    return {"regions_per_batch": round(statistics.mean(regions), 1), "file_order_rho": round(statistics.mean(rhos), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--workers", type=int, default=4, help="DataLoader workers per rank (R > 1)")
    ap.add_argument("--old-full", type=int, default=8, help="run every old reader up to this R")
    ap.add_argument("--old-sample", type=int, default=2, help="old readers run above --old-full")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "dsrecipes-bench-stream"))
    ap.add_argument("--chunk-kb", type=int, nargs="*", default=[], help="also the order quality with these chunks")
    ap.add_argument("--order-only", action="store_true", help="no reading: the index and the order quality only")
    args = add_args(ap).parse_args()
    if args.smoke:
        args.gb, args.files, args.readers, args.workers, args.chunk_kb = 2 / 1024, 4, [1, 8], 2, [16]
    with Result("bench_stream_reads", args) as result:
        if args.smoke:
            args.dir = str(result.out / "corpus")
        run(args, result)


def run(args: argparse.Namespace, result: Result) -> None:
    paths = make_corpus(Path(args.dir), args.gb, args.files)
    corpus = sum(os.path.getsize(p) for p in paths)
    index, cold, warm = index_times(paths)
    counts = [f.count for f in index.files]
    gb = corpus / (1 << 30)
    result.row({"corpus_bytes": corpus, "files": len(paths), "samples": sum(counts), "block_bytes": index.block_bytes,
                "blocks": int(index.blocks["count"].size), "index_cold_s_per_gb": round(cold / gb, 2),
                "index_warm_s": round(warm, 3)})
    max_block = max(int(np.diff(np.append(f.offsets, f.size)).max()) for f in index.files)
    print("| R | old bytes/corpus | new bytes/corpus | new bound | old MB/s, samples/s per reader | "
          "new MB/s, samples/s per reader |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate([] if args.order_only else args.readers):
        lay = layout_for(r, args.workers)
        new, old = both_schemes(i, lambda: run_new(index, lay),
                                lambda: run_old(paths, counts, lay, r if r <= args.old_full else args.old_sample))
        bound = 1 + 2 * r * max_block / corpus
        note = "" if old["measured"] == old["readers"] else f" ({old['measured']} of {r} run)"
        if note:
            result.note(f"R = {r}: old scheme: {old['measured']} of {r} readers run, its bytes are R x their mean")
        result.row({"readers": r, "old": old, "new": new, "new_bound": bound}, echo=False)
        print(f"| {r} | {old['bytes'] / corpus:.2f}{note} | {new['bytes'] / corpus:.3f} | {bound:.3f} | "
              f"{old['mb_s']:.0f}, {old['samples_s']:.0f} | {new['mb_s']:.0f}, {new['samples_s']:.0f} |", flush=True)
    for chunk_kb in [None, *args.chunk_kb]:
        chunked = index if chunk_kb is None else dataclasses.replace(index, chunk_bytes=chunk_kb << 10)
        result.row({"chunk_kb": chunk_kb, "blocks_per_chunk": blocks_per_chunk(chunked.chunk_bytes, chunked.block_bytes),
                    "order_quality_world_16x4": order_quality(chunked, counts, layout_for(64, args.workers)),
                    "order_quality_1_reader": order_quality(chunked, counts, layout_for(1, args.workers))})


if __name__ == "__main__":
    main()
