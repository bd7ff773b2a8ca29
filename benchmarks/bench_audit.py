"""`dsrecipes audit` at scale: 1M samples, world size 64, on one core (target: < 10 s).

    python benchmarks/bench_audit.py [--samples 1000000] [--world-size 64] [--num-workers 2] [--epochs 1] [--out DIR]
    python benchmarks/bench_audit.py --smoke              # 2,000 samples, world 4: every phase in seconds

Times the audit of each strategy in-process (wall and CPU seconds, the process pinned to one core when possible),
plus the whole `dsrecipes audit` command for map (`--num-rows`) and iterable (a generated JSONL file in /tmp that
the audit line-counts) including interpreter start and imports. The JSONL file is generated (2-turn ShareGPT rows)
into the result directory (--out). Result file: <out>/bench_audit.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from _harness import Result, add_args

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to CPU {cpu}"
    return "not pinned"


def timed(result: Result, label: str, fn):
    wall, cpu = time.perf_counter(), time.process_time()
    report = fn()
    return result.row({"what": label, "wall_s": round(time.perf_counter() - wall, 2),
                       "cpu_s": round(time.process_time() - cpu, 2), "ok": report.ok})


def jsonl(n: int, root: Path) -> Path:
    path = root / f"dsrecipes_audit_{n}.jsonl"
    row = '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}\n'
    with open(path, "w") as fh:
        fh.writelines(row for _ in range(n))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1)
    args = add_args(parser).parse_args()
    if args.smoke:
        args.samples, args.world_size = 2000, 4
    with Result("bench_audit", args) as result:
        run(args, result)


def run(args: argparse.Namespace, result: Result) -> None:
    result.note(one_core())
    from dsrecipes.data.plan.epoch import Layout
    from dsrecipes.data.plan.sampler import count_rows
    from dsrecipes.data.strategies.audit import audit_map, audit_presharded, audit_stream

    n, w = args.samples, args.world_size
    lay = Layout(w, 4, 2, args.num_workers)
    path = jsonl(n, result.out)
    timed(result, f"map: {n} rows, world {w}", lambda: audit_map(n, lay, 42, True, args.epochs))
    timed(result, f"iterable: {n} lines (count + plan), world {w}",
          lambda: audit_stream([count_rows(str(path))], lay, 42, True, 1024, args.epochs))
    parts = [n // w + (1 if r < n % w else 0) for r in range(w)]
    timed(result, f"presharded: {w} parts of {min(parts)}, world {w}", lambda: audit_presharded(parts, lay, 42, True, 1024, args.epochs))

    common = ["--world-size", str(w), "--num-workers", str(args.num_workers), "--epochs", str(args.epochs),
              "trainer.micro_batch_size=4", "trainer.grad_accum=2"]
    commands = {
        "CLI map --num-rows": ["--num-rows", str(n)],
        "CLI iterable": ["data=iterable", "dataset=sharegpt_files", f"dataset.paths=[{path}]", "trainer.max_steps=100"],
    }
    for label, extra in commands.items():
        cmd = ["taskset", "-c", "0"] if _has_taskset() else []
        cmd += [sys.executable, "-m", "dsrecipes", "audit", *extra, *common]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        result.row({"what": f"{label} (whole command, one core)", "wall_s": round(time.perf_counter() - start, 2),
                    "exit": proc.returncode,
                    "last_line": proc.stdout.strip().splitlines()[-1] if proc.stdout else proc.stderr[-300:]})
        if proc.returncode != 0:
            raise SystemExit(f"{label}: `{' '.join(cmd)}` exited {proc.returncode}: {proc.stderr[-1000:]}")


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


if __name__ == "__main__":
    main()
