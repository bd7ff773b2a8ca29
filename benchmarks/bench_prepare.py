"""Speed of data preparation against the batched fast-tokenizer ceiling, measured in the same run.

    python benchmarks/bench_prepare.py                         # both shapes, 100,000 conversations each, 2 rounds
    python benchmarks/bench_prepare.py --n 20000 --rounds 3    # a quicker look
    python benchmarks/bench_prepare.py --shape chat --per-segment   # also prepare() with per-segment tokenization
    python benchmarks/bench_prepare.py --smoke                 # 200 chat conversations, 1 round, --per-segment
                                                               # (only the ceiling in a fresh interpreter)

Corpus shapes (generated, seeded, written to a JSONL file; bundled tiny byte-level BPE tokenizer, template=chatml,
`data.cutoff_len=1024`):
* chat: 1-3 user/assistant exchanges, ~184 tokens after templating, ~10% CJK words;
* long: 1-4 exchanges with long-tailed lengths, some system prompts and tool calls, ~320 tokens.

Each round runs, alternately (ceiling first in even rounds, prepare first in odd ones):
* ceiling: the fast tokenizer's Rust `encode_batch` on the already rendered full texts (all cores, no masks, no
  reading, no writing), with a fresh tokenizer (its BPE word cache starts empty, as in a worker);
* prepare: the whole `dsrecipes.data.prepare.build.prepare()` from the file into a fresh cache directory: read, check,
  render, tokenize, labels, truncation, split, Arrow write, with `data.preprocess_workers=2`;
* with --per-segment: the same prepare() with per-segment tokenization forced (what one-text tokenization buys).
Prints samples/s per round, the prepare/ceiling ratio per round, and medians with their spread: the wall-clock
share (the target: prepare >= 0.75 of the ceiling's samples/s) and the CPU share (ceiling CPU seconds / prepare's,
workers included), which neighbours on a shared machine disturb much less. Each prepare() run reports how it
tokenized (`one_text`); a per-segment run that still tokenized as one text stops the benchmark (the switch below
no longer reaches the encoder). Result file: <out>/bench_prepare.json (--out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

from _harness import Result, add_args

EN_WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had "
            "by word but what some we can out other were all there when up use your how said an each she which do "
            "their time if will way about many then them write would like so these her long make thing see him two "
            "has look").split()
CJK_WORDS = "法国 首都 巴黎 天气 今天 多少 等于 加 减 转换 千米 米 单词 倒过来".split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(CJK_WORDS) if rng.random() < 0.1 else rng.choice(EN_WORDS) for _ in range(n))


def chat_row(rng: random.Random, i: int) -> dict:
    """1-3 exchanges; questions ~9 words, answers ~20 (lognormal): ~184 tokens with the tiny tokenizer."""
    turns = []
    for _ in range(rng.randint(1, 3)):
        turns.append({"from": "human", "value": _words(rng, max(1, int(rng.lognormvariate(0, 0.5) * 9)))})
        turns.append({"from": "gpt", "value": _words(rng, max(1, int(rng.lognormvariate(0, 0.5) * 20)))})
    return {"id": f"chat-{i}", "conversations": turns}


def long_row(rng: random.Random, i: int) -> dict:
    def text(mean: float) -> str:
        return _words(rng, max(1, min(400, int(rng.lognormvariate(mean, 0.9)))))

    turns = []
    for _ in range(rng.choice([1, 1, 2, 2, 3, 4])):
        turns.append({"from": "human", "value": text(2.5)})
        if rng.random() < 0.1:
            turns.append({"from": "function_call", "value": json.dumps({"name": "lookup", "arguments": {"q": text(1.0)}})})
            turns.append({"from": "observation", "value": json.dumps({"result": text(1.5)})})
        turns.append({"from": "gpt", "value": text(3.0)})
    row = {"id": f"long-{i}", "conversations": turns}
    if rng.random() < 0.3:
        row["system"] = text(1.5)
    return row


SHAPES: Dict[str, Callable[[random.Random, int], dict]] = {"chat": chat_row, "long": long_row}


def write_corpus(path: Path, shape: str, n: int) -> None:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps(SHAPES[shape](rng, i), ensure_ascii=False) + "\n")


def load_cfg(data: Path, cache: Path, workers: int):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load([f"dataset.paths=[{data}]", "dataset.val_size=0", "data.cutoff_len=1024",
                             f"data.preprocess_workers={workers}", f"data.cache_dir={cache}", "template=chatml"])


def rendered_texts(cfg, tokenizer) -> List[str]:
    from dsrecipes.data.render.template import render
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.sharegpt import iter_conversations

    convs = iter_conversations(cfg.dataset, report=BadRowReport(cfg.dataset.bad_rows, 1.0))
    return ["".join(s.text for s in render(c, cfg.template, tokenizer, cfg.data.train_on)) for c in convs]


def cpu_now() -> float:
    """CPU seconds of this process and its finished children (prepare's workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def time_ceiling(tokenizer, texts: List[str]) -> tuple[float, float]:
    from tokenizers import Tokenizer

    fresh = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    start, cpu = time.perf_counter(), cpu_now()
    fresh.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - start, cpu_now() - cpu


def time_prepare(cfg, tokenizer, run_dir: Path, per_segment: bool) -> tuple[float, float, dict]:
    from dsrecipes.data.prepare.build import prepare
    from dsrecipes.data.render import tokenize

    shutil.rmtree(cfg.data.cache_dir, ignore_errors=True)
    init = tokenize.Encoder.__init__
    if per_segment:  # the workers are forked from this process, so they inherit the switch
        tokenize.Encoder.__init__ = lambda self, tok, c, full_text=None: init(self, tok, c, full_text=False)
    try:
        start, cpu = time.perf_counter(), cpu_now()
        prep = prepare(cfg, tokenizer, run_dir)
        return time.perf_counter() - start, cpu_now() - cpu, prep.stats
    finally:
        tokenize.Encoder.__init__ = init


def measure_one(kind: str, data: Path, tmp: Path, workers: int) -> Dict[str, float]:
    """One measurement in this (fresh) process: ceiling, prepare or per-segment."""
    import datasets  # noqa: F401  (imported up front: its ~2 s import is not preparation time)
    from transformers import AutoTokenizer

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))
    cfg = load_cfg(data, tmp / f"cache-{kind}", workers)
    if kind == "ceiling":
        wall, cpu = time_ceiling(tokenizer, rendered_texts(cfg, tokenizer))
        return {"wall": wall, "cpu": cpu}
    wall, cpu, stats = time_prepare(cfg, tokenizer, tmp / f"run-{kind}", kind == "per-segment")
    shutil.rmtree(cfg.data.cache_dir, ignore_errors=True)
    return {"wall": wall, "cpu": cpu, "tokens": stats["tokens"], "rows": stats["rows_kept"],
            "one_text": stats["tokenization"]["one_text"]}


def run_one(kind: str, data: Path, tmp: Path, workers: int, here: bool = False) -> Dict[str, float]:
    """`measure_one` in a fresh interpreter, so no measurement inherits another's memory, caches or threads (`here`:
    in this process, --smoke only)."""
    if here:
        got = measure_one(kind, data, tmp, workers)
    else:
        out = subprocess.run([sys.executable, __file__, "--one", kind, "--data", str(data), "--tmp", str(tmp),
                              "--workers", str(workers)], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
        got = json.loads(out.stdout.strip().splitlines()[-1])
    if kind == "per-segment" and got["one_text"]:
        raise SystemExit("per-segment: prepare() still tokenized as one text; the Encoder switch in time_prepare no "
                         "longer reaches the encoder (dsrecipes/data/render/tokenize.py changed?)")
    return got


def bench_shape(shape: str, args, tmp: Path, result: Result) -> List[str]:
    data = tmp / f"{shape}.jsonl"
    write_corpus(data, shape, args.n)
    kinds = ["ceiling", "prepare"] + (["per-segment"] if args.per_segment else [])
    wall: Dict[str, List[float]] = {k: [] for k in kinds}
    cpu: Dict[str, List[float]] = {k: [] for k in kinds}
    tokens = 0.0
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            got = run_one(kind, data, tmp, args.workers, here=args.smoke and kind != "ceiling")
            result.row({"shape": shape, "round": r, "kind": kind, "n": args.n, **got}, echo=False)
            wall[kind].append(got["wall"])
            cpu[kind].append(got["cpu"])
            if "tokens" in got:
                tokens = got["tokens"] / got["rows"]
        line = ", ".join(f"{k} {args.n / wall[k][-1]:,.0f}/s ({cpu[k][-1]:.1f} CPU s)" for k in kinds)
        print(f"{shape} round {r + 1}: {line}; prepare/ceiling {wall['ceiling'][-1] / wall['prepare'][-1]:.2f} "
              f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    rows = []
    for kind in kinds:
        rates = [args.n / s for s in wall[kind]]
        share = [c / s for c, s in zip(wall["ceiling"], wall[kind])]
        work = [c / s for c, s in zip(cpu["ceiling"], cpu[kind])]
        rows.append(f"| {shape} ({tokens:.0f} tokens/sample) | {kind} | {statistics.median(rates):,.0f} | "
                    f"{min(rates):,.0f}-{max(rates):,.0f} | {statistics.median(share):.2f} ({min(share):.2f}-"
                    f"{max(share):.2f}) | {statistics.median(work):.2f} ({min(work):.2f}-{max(work):.2f}) |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="conversations per shape")
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="data.preprocess_workers")
    parser.add_argument("--per-segment", action="store_true", help="also time prepare() with per-segment tokenization")
    parser.add_argument("--one", choices=["ceiling", "prepare", "per-segment"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", type=Path, help=argparse.SUPPRESS)
    args = add_args(parser).parse_args()
    os.environ.pop("TOKENIZERS_PARALLELISM", None)  # the ceiling uses every core; prepare's workers set their own
    if args.one:
        print(json.dumps(measure_one(args.one, args.data, args.tmp, args.workers)))
        return
    if args.smoke:
        args.n, args.shape, args.rounds, args.per_segment = 200, "chat", 1, True
    with Result("bench_prepare", args) as result:
        run(args, result)


def run(args: argparse.Namespace, result: Result) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        rows = []
        if args.smoke:  # the other shape's generator at least runs
            write_corpus(tmp / "long-smoke.jsonl", "long", 20)
            result.note("smoke: only the chat shape is measured (20 rows of the long shape generated, not measured)")
            result.note("smoke: only the ceiling is measured in a fresh interpreter; prepare and per-segment run in "
                        "this process (one import of datasets/transformers/torch for both)")
        for shape in SHAPES if args.shape == "all" else [args.shape]:
            rows += bench_shape(shape, args, tmp, result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{args.n:,} conversations per shape, tiny byte-level BPE tokenizer, chatml, cutoff 1024, "
          f"{args.workers} workers, {os.cpu_count()} CPUs, {args.rounds} rounds, each measurement in a fresh process "
          f"(load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())})\n")
    print("| corpus | method | samples/s (median) | range | wall share of the ceiling, median (range) | "
          "CPU share of the ceiling, median (range) |")
    print("|---|---|---:|---:|---:|---:|")
    print("\n".join(rows))
    result.extra["table"] = rows


if __name__ == "__main__":
    main()
