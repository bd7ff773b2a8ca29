"""Peak memory of preparation for one huge row: the launching process of a dry run, with and without the row.

    python benchmarks/bench_row_memory.py                   # rows of 4, 16 and 50 MB, 2 repeats each
    python benchmarks/bench_row_memory.py --sizes 16 --repeats 3
    python benchmarks/bench_row_memory.py --smoke           # one row of 0.2 MB, 1 repeat: every phase in seconds

Each measurement is a fresh `python -m dsrecipes ... launcher.dry_run=true` (map preparation: read, normalise,
render, tokenize, write Arrow) on 16 small rows plus one row of SIZE MB of text, against the same command on the 16
small rows alone, run alternately; the number reported is the median growth of the child's peak RSS. Rows up to
`dataset.max_row_bytes` (default 16 MiB) are allowed and tokenized by their head (data/render/tokenize.py); a larger row is
a too_large bad row skipped without being held (run with `dataset.bad_rows=skip`). Target: growth within a small
multiple (<= 8x) of the largest allowed row. Before issue 11 a 4 MB row grew the peak by ~0.5 GB and 16 MB by ~2.5 GB.
Result file: <out>/bench_row_memory.json (--out DIR).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import Result, add_args


def write_data(path: Path, big_mb: float) -> None:
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(16):
            fh.write(json.dumps(good) + "\n")
        if big_mb:
            text = ("lorem ipsum dolor sit amet consectetur " * int(big_mb * 30000))[: int(big_mb * 1e6)]
            fh.write(json.dumps({"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]})
                     + "\n")


WRAP = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:], capture_output=True).returncode; "
        "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def peak_rss_mib(data: Path, work: Path, tag: str) -> float:
    """Peak RSS of one dry run, in MiB (ru_maxrss of its only child, measured by a fresh wrapper process)."""
    cmd = [sys.executable, "-m", "dsrecipes", f"dataset.paths=[{data}]", "dataset.val_size=0",
           "dataset.bad_rows=skip", "dataset.max_bad_fraction=0.5", "trainer.micro_batch_size=2",
           "launcher.dry_run=true", f"trainer.output_dir={work / tag}", f"data.cache_dir={work / ('cache-' + tag)}"]
    out = subprocess.run([sys.executable, "-c", WRAP, *cmd], capture_output=True, text=True, check=True, cwd=work)
    rc, kib = map(int, out.stdout.split())
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}")
    return kib / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[50, 16, 4], help="row sizes in MB")
    parser.add_argument("--repeats", type=int, default=2)
    args = add_args(parser).parse_args()
    if args.smoke:
        args.sizes, args.repeats = [0.2], 1
    with Result("bench_row_memory", args) as result:
        measure(args, result)


def measure(args: argparse.Namespace, result: Result) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = work / "base.jsonl"
        write_data(base, 0)
        print("row MB | peak growth MiB (median, spread) | growth / row size")
        for size in args.sizes:
            data = work / f"big{size}.jsonl"
            write_data(data, size)
            growth = []
            for r in range(args.repeats):
                big = peak_rss_mib(data, work, f"b{size}-{r}")
                growth.append(big - peak_rss_mib(base, work, f"s{size}-{r}"))
            med = statistics.median(growth)
            print(f"{size:6.1f} | {med:8.1f} ({min(growth):.1f} .. {max(growth):.1f}) | {med / (size * 1e6 / 2**20):.1f}x")
            result.row({"row_mb": size, "growth_mib": growth, "median_growth_mib": med,
                        "growth_over_row": med / (size * 1e6 / 2**20)}, echo=False)


if __name__ == "__main__":
    main()
