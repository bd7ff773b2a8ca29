"""Loader throughput of each data strategy, and peak memory of streaming as the data grows.

    python benchmarks/bench_loaders.py                       # throughput on a generated 20k-conversation corpus
    python benchmarks/bench_loaders.py --memory 10000 1000000  # peak RSS of data=iterable (corpus in /tmp)
    python benchmarks/bench_loaders.py --smoke               # 80 conversations, 1 rep, --memory 320 (world 32 needs 256): seconds

Throughput: one epoch of rank 0 of a world of 2 (so every strategy reads half the corpus), with 0 and 2 DataLoader
workers, in samples/s and tokens/s (real tokens of the collated micro-batches), against a plain loop that reads,
parses, tokenizes and collates the same JSONL in one process. Every reader runs --reps times (default 3), the order
reversed from one repetition to the next, each loader built afresh; reported: the median and [min, max] over the
repetitions, and each reader's samples/s over the plain loop's of the same repetition (median [min, max]).

What each number counts (the same work is not done inside every epoch, so there are three rates):
  samples/s        the epoch only. The plain loop tokenizes inside it; `map` and `presharded` read rows tokenized
                   before it (by `prepare` / `dsrecipes shard`), and `iterable` tokenizes inside it. The reader's setup
                   (the launching process's part: `write_run_dir`, which for `map` is a prepared-cache hit here and for
                   `iterable` the stream index and row pre-scan; then `build_loaders`) is outside it: `setup_s`.
  with setup       samples / (setup + epoch): what one run of the reader costs before and during its epoch.
  per CPU s        samples / CPU seconds of the epoch (this process plus its reaped children: DataLoader workers), so
                   2 workers (3 processes) and the one-process plain loop are compared on the work done, not on how
                   many cores the machine lends them.
`map, cold cache` and `iterable, cold cache` (0 workers) are the same readers from a fresh data.cache_dir each
repetition: their setup includes `prepare` (tokenizing the whole corpus, both ranks' rows, data.preprocess_workers=1)
and the stream index + pre-scan: a first run's cost, which the warm rows leave out. `dsrecipes shard` (presharded's
offline step) is timed once and reported as a one-off, like the first `prepare`.

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


def cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (DataLoader workers are joined at the end of an epoch)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measure(make) -> Dict[str, float]:
    """Build the reader (`make()`: setup_s, setup_cpu_s), then one epoch of it (seconds, cpu_s)."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    batches = make()
    setup, c1 = time.perf_counter() - t0, cpu_seconds()
    start = time.perf_counter()
    samples = tokens = 0
    for batch in batches:
        samples += len(batch["ids"])
        tokens += int(batch["num_tokens"])
    secs, cpu = time.perf_counter() - start, cpu_seconds() - c1
    return {"samples": samples, "seconds": round(secs, 2), "samples_per_s": round(samples / secs),
            "tokens_per_s": round(tokens / secs), "setup_s": round(setup, 2), "setup_cpu_s": round(c1 - c0, 2),
            "with_setup_samples_per_s": round(samples / (setup + secs)), "cpu_s": round(cpu, 2),
            "samples_per_cpu_s": round(samples / max(cpu, 1e-9))}


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

    def strategy(name: str, workers: int, rep: int, cold: bool = False):
        cache = [f"data.cache_dir={work / f'cold-{name}-{rep}'}"] if cold else []  # a first run: nothing cached
        c = compose_and_load(base + kinds[name] + [f"data.num_workers={workers}"] + cache)
        run_k = work / f"run-{name}-{workers}-{rep}{'-cold' if cold else ''}"  # the launching process's part, then rank 0
        plan = write_run_dir(with_run_dir(c, run_k), Topology(2, 1, 2))
        return build_loaders(c, tok, 0, 2, run_k, plan)[0]

    readers = [(PLAIN, 0, lambda rep: plain_loop(cfg, tok, paths))]
    readers += [(f"{name} (rank 0 of 2)", w, lambda rep, n=name, w=w: strategy(n, w, rep))
                for name in kinds for w in (0, 2)]
    readers += [(f"{name}, cold cache (rank 0 of 2)", 0, lambda rep, n=name: strategy(n, 0, rep, cold=True))
                for name in ("map", "iterable")]
    results: List[Dict[str, object]] = []
    for rep in range(reps):
        for label, workers, make in readers if rep % 2 == 0 else readers[::-1]:
            results.append({"strategy": label, "workers": workers, "rep": rep, **measure(lambda: make(rep))})
    results += summary(results)
    results.append({"strategy": "one-off: prepare (map)", "seconds": round(prep_s, 2)})
    results.append({"strategy": "one-off: shard --parts 2 (presharded)", "seconds": round(shard_s, 2)})
    return results


def summary(runs: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Per reader: the median over the repetitions and the spread [min, max] of samples/s and tokens/s, and its
    samples/s over the plain loop's of the same repetition (median [min, max])."""
    plain = {r["rep"]: r for r in runs if r["strategy"] == PLAIN}
    out = []
    for label, workers in dict.fromkeys((r["strategy"], r["workers"]) for r in runs):
        mine = [r for r in runs if (r["strategy"], r["workers"]) == (label, workers)]
        rates, toks = [r["samples_per_s"] for r in mine], [r["tokens_per_s"] for r in mine]
        row = {"strategy": label, "workers": workers, "reps": len(mine), "samples": mine[0]["samples"],
               "samples_per_s": statistics.median(rates), "samples_per_s_range": [min(rates), max(rates)],
               "tokens_per_s": statistics.median(toks), "tokens_per_s_range": [min(toks), max(toks)]}
        for key, name in (("samples_per_s", "vs_plain"), ("with_setup_samples_per_s", "vs_plain_with_setup"),
                          ("samples_per_cpu_s", "vs_plain_per_cpu_s")):
            if all(key in r for r in mine):  # each against the plain loop's of the same repetition
                ratio = [r[key] / plain[r["rep"]][key] for r in mine]
                row[name] = round(statistics.median(ratio), 2)
                row[name + "_range"] = [round(min(ratio), 2), round(max(ratio), 2)]
        for key in ("setup_s", "with_setup_samples_per_s", "samples_per_cpu_s"):
            if all(key in r for r in mine):
                row[key] = statistics.median([r[key] for r in mine])
        out.append(row)
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
        stats = measure(lambda: loader)
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
          f"{'vs plain loop, same rep':>24} {'setup s':>8} {'with setup: vs plain':>22} {'per CPU s: vs plain':>22}")
    for r in rows:
        if "rep" in r:  # one repetition's row: in the result file
            continue
        if "reps" not in r:
            print(f"{r['strategy']:<40} {'':>7} {'':>8} {r['seconds']:>26} s")
            continue
        lo, hi = r["samples_per_s_range"]
        print(f"{r['strategy']:<40} {r['workers']:>7} {r['samples']:>8} {r['samples_per_s']:>10} [{lo}, {hi}]"
              f"{r['tokens_per_s']:>10} {r['vs_plain']:>10} {r['vs_plain_range']} {r['setup_s']:>8} "
              f"{r['vs_plain_with_setup']:>6} {r['vs_plain_with_setup_range']} {r['vs_plain_per_cpu_s']:>6} "
              f"{r['vs_plain_per_cpu_s_range']}")
    print("samples/s: the epoch only (map and presharded read rows tokenized before it; the plain loop and iterable "
          "tokenize inside it); with setup: samples / (setup + epoch), setup = the launch part + build_loaders (cold "
          "cache: prepare / index + pre-scan included); per CPU s: samples / CPU s of the epoch, workers included")

if __name__ == "__main__":
    main()
