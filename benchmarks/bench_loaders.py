"""Loader throughput of each data strategy, and peak memory of streaming as the data grows.

    python benchmarks/bench_loaders.py                       # throughput on a generated 20k-conversation corpus
    python benchmarks/bench_loaders.py --memory 10000 1000000  # peak RSS of data=iterable (corpus in /tmp)
    python benchmarks/bench_loaders.py --smoke               # 80 conversations, 1 rep, --memory 320 (world 32 needs 256): seconds

Throughput: one epoch of rank 0 of a world of 2 (so every strategy reads half the corpus), with 0 and 2 DataLoader
workers, in samples/s and tokens/s (real tokens of the collated micro-batches), against a plain loop that reads,
parses, tokenizes and collates the same JSONL in one process. Every reader runs --reps times (default 3), the order
reversed from one repetition to the next, each loader built afresh; reported: the median and [min, max] over the
repetitions, and each reader's samples/s over the plain loop's of the same repetition (median [min, max]). `map` excludes its one-off `prepare` (reported
separately, it is cached); `presharded` excludes `dsrecipes shard` (also reported).

Memory: a child process per size runs a full epoch of data=iterable (rank 0 of a world of 32, no workers: it reads
and tokenizes its 1/32 of the blocks) over one JSONL file of N conversations and reports its peak RSS (ru_maxrss)
and the RSS before iterating (the stream index, built by the loader here, is part of it).

Both corpora are generated from the bundled sample rows (dsrecipes/assets/sample_data). Result file:
<out>/bench_loaders.json (--out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from _harness import Result, add_args

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
MBS = 8
MEMORY_WORLD = 32
PLAIN = "plain loop (all samples, 1 process)"


def generate(out_dir: Path, conversations: int, files: int = 1) -> List[str]:
    """`conversations` rows cycled from the bundled sample data with fresh ids, in `files` files of uneven size."""
    bases = []
    with open(SAMPLE, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            row.pop("id", None)
            bases.append(json.dumps(row, ensure_ascii=False)[1:])
    weights = [2**i for i in range(files)]  # very uneven: each file twice the previous
    sizes = [conversations * w // sum(weights) for w in weights]
    sizes[-1] += conversations - sum(sizes)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths, k = [], 0
    for f, size in enumerate(sizes):
        path = out_dir / f"conv_{f:02d}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for _ in range(size):
                fh.write(f'{{"id": "c{k}", ' + bases[k % len(bases)] + "\n")
                k += 1
        paths.append(str(path))
    return paths


def overrides_for(paths: List[str], cache: Path) -> List[str]:
    return ["dataset=sharegpt_files", "dataset.paths=[" + ",".join(paths) + "]", "dataset.val_size=0",
            "dataset.bad_rows=error", f"trainer.micro_batch_size={MBS}", "trainer.grad_accum=1", "trainer.max_steps=null",
            "trainer.epochs=1", f"data.cache_dir={cache}", "data.cutoff_len=512", "scheduler.warmup_steps=0"]


def measure(batches) -> Dict[str, float]:
    start = time.perf_counter()
    samples = tokens = 0
    for batch in batches:
        samples += len(batch["ids"])
        tokens += int(batch["num_tokens"])
    secs = time.perf_counter() - start
    return {"samples": samples, "seconds": round(secs, 2), "samples_per_s": round(samples / secs),
            "tokens_per_s": round(tokens / secs)}


def plain_loop(cfg, tokenizer, paths: List[str]):
    """The baseline: read + parse + normalise + tokenize + collate every line, one process, no planning."""
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.sharegpt import normalize_row
    from dsrecipes.objectives.sft import collate

    enc = Encoder(tokenizer, cfg)
    source = SourceConfig(name="x")
    pad = tokenizer.pad_token_id
    convs = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                raw = json.loads(line)
                convs.append(normalize_row(raw, raw["id"], source))
                if len(convs) == MBS:
                    rows = [{"ids": [e.id], "input_ids": e.input_ids, "labels": e.labels} for e in enc.encode_batch(convs) if e]
                    yield collate(rows, pad)
                    convs = []


def throughput(conversations: int, work: Path, reps: int) -> List[Dict[str, object]]:
    """Every reader (the plain loop, each strategy x workers) once per repetition, the order reversed from one
    repetition to the next (A/B, B/A), each loader built afresh: a one-off cost (the first tokenizer call, a lazy
    import, a file's first read) falls on whichever runs first, so it alternates instead of always hitting one."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.core.topology import Topology
    from dsrecipes.data.prepare.build import prepare
    from dsrecipes.data.shard.build import ShardBalance, shard
    from dsrecipes.data.strategies import build_loaders
    from dsrecipes.run.entry import with_run_dir, write_run_dir

    paths = generate(work / "corpus", conversations, files=5)
    base = overrides_for(paths, work / "cache")
    cfg = compose_and_load(base)
    tok = load_tokenizer(cfg)
    t = time.perf_counter()
    prepare(cfg, tok, work / "run")
    prep_s = time.perf_counter() - t
    t = time.perf_counter()
    shard(cfg, 2, str(work / "shards"), ShardBalance.samples, force=True)
    shard_s = time.perf_counter() - t
    kinds = {
        "map": [],
        "iterable": ["data=iterable", f"data.num_samples={conversations}"],
        "presharded": ["data=presharded", f"data.shard_dir={work / 'shards'}"],
    }

    def strategy(name: str, workers: int, rep: int):
        c = compose_and_load(base + kinds[name] + [f"data.num_workers={workers}"])
        run_k = work / f"run-{name}-{workers}-{rep}"  # the launching process's part (map: a cache hit), then rank 0
        plan = write_run_dir(with_run_dir(c, run_k), Topology(2, 1, 2))
        return build_loaders(c, tok, 0, 2, run_k, plan)[0]

    readers = [(PLAIN, 0, lambda rep: plain_loop(cfg, tok, paths))]
    readers += [(f"{name} (rank 0 of 2)", w, lambda rep, n=name, w=w: strategy(n, w, rep))
                for name in kinds for w in (0, 2)]
    results: List[Dict[str, object]] = []
    for rep in range(reps):
        for label, workers, make in readers if rep % 2 == 0 else readers[::-1]:
            results.append({"strategy": label, "workers": workers, "rep": rep, **measure(make(rep))})
    results += summary(results)
    results.append({"strategy": "one-off: prepare (map)", "seconds": round(prep_s, 2)})
    results.append({"strategy": "one-off: shard --parts 2 (presharded)", "seconds": round(shard_s, 2)})
    return results


def summary(runs: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per reader: the median over the repetitions and the spread [min, max] of samples/s and tokens/s, and its
    samples/s over the plain loop's of the same repetition (median [min, max])."""
    plain = {r["rep"]: r["samples_per_s"] for r in runs if r["strategy"] == PLAIN}
    out = []
    for label, workers in dict.fromkeys((r["strategy"], r["workers"]) for r in runs):
        mine = [r for r in runs if (r["strategy"], r["workers"]) == (label, workers)]
        rates, toks = [r["samples_per_s"] for r in mine], [r["tokens_per_s"] for r in mine]
        ratio = [r["samples_per_s"] / plain[r["rep"]] for r in mine]
        out.append({"strategy": label, "workers": workers, "reps": len(mine), "samples": mine[0]["samples"],
                    "samples_per_s": statistics.median(rates), "samples_per_s_range": [min(rates), max(rates)],
                    "tokens_per_s": statistics.median(toks), "tokens_per_s_range": [min(toks), max(toks)],
                    "vs_plain": round(statistics.median(ratio), 2), "vs_plain_range": [round(min(ratio), 2),
                                                                                        round(max(ratio), 2)]})
    return out


def memory_child(path: str, conversations: int) -> None:
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.core.topology import Topology
    from dsrecipes.data.strategies import build_loaders
    from dsrecipes.run.entry import with_run_dir, write_run_dir

    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose_and_load(overrides_for([path], Path(tmp)) + ["data=iterable", f"data.num_samples={conversations}",
                                                                   "data.prescan=false"])
        tok = load_tokenizer(cfg)
        run = Path(tmp) / "run"  # the launching process indexes the stream (no pre-scan: the loader's memory only)
        plan = write_run_dir(with_run_dir(cfg, run), Topology(MEMORY_WORLD, 1, MEMORY_WORLD))
        loader = build_loaders(cfg, tok, 0, MEMORY_WORLD, run, plan)[0]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        stats = measure(loader)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"conversations": conversations, "rss_before_mib": round(before / 1024, 1),
                      "peak_rss_mib": round(peak / 1024, 1), **stats}))


def memory(sizes: List[int], root: Path) -> List[Dict[str, object]]:
    out = []
    for n in sizes:
        path = root / f"dsrecipes_bench_{n}.jsonl"
        if not path.is_file() or sum(1 for _ in open(path, "rb")) != n:
            generated = generate(root / f"dsrecipes_bench_{n}", n, files=1)[0]
            os.replace(generated, path)
            os.rmdir(Path(generated).parent)
        proc = subprocess.run([sys.executable, __file__, "--memory-child", str(path), str(n)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise SystemExit(f"memory child for {n} conversations exited {proc.returncode}:\n{proc.stderr[-2000:]}")
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of every reader, alternating order")
    parser.add_argument("--memory", type=int, nargs="*", default=None, metavar="N")
    parser.add_argument("--memory-child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = add_args(parser).parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.memory_child:
        memory_child(args.memory_child[0], int(args.memory_child[1]))
        return
    if args.smoke:
        args.conversations, args.reps = 80, 1
    with Result("bench_loaders", args) as result:
        if args.memory is not None or args.smoke:
            memory_rows(args.memory or ([320] if args.smoke else [10000, 1000000]), result)
        if args.memory is None:
            throughput_rows(args.conversations, args.reps, result)


def memory_rows(sizes: List[int], result: Result) -> None:
    rows = memory(sizes, result.out if result.smoke else Path(tempfile.gettempdir()))
    for row in rows:
        result.row({"phase": "memory", **row})
    if len(rows) > 1:
        growth = rows[-1]["peak_rss_mib"] / rows[0]["peak_rss_mib"] - 1
        print(f"peak RSS growth {rows[0]['conversations']} -> {rows[-1]['conversations']}: {growth:+.1%}")


def throughput_rows(conversations: int, reps: int, result: Result) -> None:
    with tempfile.TemporaryDirectory(prefix="dsrecipes-bench-") as tmp:
        rows = throughput(conversations, Path(tmp), reps)
    for r in rows:
        result.row({"phase": "throughput", **r}, echo=False)
    print(f"{'strategy':<40} {'workers':>7} {'samples':>8} {'samples/s median [min, max]':>28} {'tokens/s':>10} "
          f"{'vs plain loop, same rep':>24}")
    for r in rows:
        if "rep" in r:  # one repetition's row: in the result file
            continue
        if "reps" not in r:
            print(f"{r['strategy']:<40} {'':>7} {'':>8} {r['seconds']:>26} s")
            continue
        lo, hi = r["samples_per_s_range"]
        print(f"{r['strategy']:<40} {r['workers']:>7} {r['samples']:>8} {r['samples_per_s']:>10} [{lo}, {hi}]"
              f"{r['tokens_per_s']:>10} {r['vs_plain']:>10} {r['vs_plain_range']}")


if __name__ == "__main__":
    main()
