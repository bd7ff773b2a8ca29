"""Speed of data preparation against the batched fast-tokenizer ceiling, measured in the same run.

    python benchmarks/bench_prepare.py                         # both shapes, 100,000 conversations each, 2 rounds
    python benchmarks/bench_prepare.py --n 20000 --rounds 3    # a quicker look
    python benchmarks/bench_prepare.py --shape chat --per-segment   # also prepare() with per-segment tokenization

Corpus shapes (generated, seeded, written to a JSONL file; bundled tiny byte-level BPE tokenizer, template=chatml,
`data.cutoff_len=1024`):
* chat: 1-3 user/assistant exchanges, ~184 tokens after templating, ~10% CJK words;
* long: 1-4 exchanges with long-tailed lengths, some system prompts and tool calls, ~320 tokens.

Each round runs, alternately (ceiling first in even rounds, prepare first in odd ones):
* ceiling: the fast tokenizer's Rust `encode_batch` on the already rendered full texts (all cores, no masks, no
  reading, no writing), with a fresh tokenizer (its BPE word cache starts empty, as in a worker);
* prepare: the whole `dsrecipes.data.prepare.prepare()` from the file into a fresh cache directory: read, check,
  render, tokenize, labels, truncation, split, Arrow write, with `data.preprocess_workers=2`;
* with --per-segment: the same prepare() with per-segment tokenization forced (what one-text tokenization buys).
Prints samples/s per round, the prepare/ceiling ratio per round, and medians with their spread.
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
from pathlib import Path
from typing import Callable, Dict, List

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
    from dsrecipes.data.badrows import BadRowReport
    from dsrecipes.data.sharegpt import iter_conversations
    from dsrecipes.data.template import render

    convs = iter_conversations(cfg.dataset, report=BadRowReport(cfg.dataset.bad_rows, 1.0))
    return ["".join(s.text for s in render(c, cfg.template, tokenizer, cfg.data.train_on)) for c in convs]


def time_ceiling(tokenizer, texts: List[str]) -> float:
    from tokenizers import Tokenizer

    fresh = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    start = time.perf_counter()
    fresh.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - start


def time_prepare(cfg, tokenizer, run_dir: Path, per_segment: bool) -> tuple[float, dict]:
    from dsrecipes.data import tokenize
    from dsrecipes.data.prepare import prepare

    shutil.rmtree(cfg.data.cache_dir, ignore_errors=True)
    init = tokenize.Encoder.__init__
    if per_segment:  # the workers are forked from this process, so they inherit the switch
        tokenize.Encoder.__init__ = lambda self, tok, c, full_text=None: init(self, tok, c, full_text=False)
    try:
        start = time.perf_counter()
        prep = prepare(cfg, tokenizer, run_dir)
        return time.perf_counter() - start, prep.stats
    finally:
        tokenize.Encoder.__init__ = init


def bench_shape(shape: str, args, tmp: Path, tokenizer) -> List[str]:
    data = tmp / f"{shape}.jsonl"
    write_corpus(data, shape, args.n)
    cfg = load_cfg(data, tmp / "cache", args.workers)
    texts = rendered_texts(cfg, tokenizer)
    kinds = ["ceiling", "prepare"] + (["per-segment"] if args.per_segment else [])
    seconds: Dict[str, List[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            if kind == "ceiling":
                seconds[kind].append(time_ceiling(tokenizer, texts))
            else:
                dt, stats = time_prepare(cfg, tokenizer, tmp / "run", kind == "per-segment")
                seconds[kind].append(dt)
        line = ", ".join(f"{k} {args.n / seconds[k][-1]:,.0f}/s" for k in kinds)
        print(f"{shape} round {r + 1}: {line}, prepare/ceiling {seconds['ceiling'][-1] / seconds['prepare'][-1]:.2f}",
              file=sys.stderr, flush=True)
    tokens = stats["tokens"] / stats["rows_kept"]
    ratios = [c / p for c, p in zip(seconds["ceiling"], seconds["prepare"])]
    rows = []
    for kind in kinds:
        rates = [args.n / s for s in seconds[kind]]
        share = [c / s for c, s in zip(seconds["ceiling"], seconds[kind])]
        rows.append(f"| {shape} ({tokens:.0f} tokens/sample) | {kind} | {statistics.median(rates):,.0f} | "
                    f"{min(rates):,.0f}-{max(rates):,.0f} | {statistics.median(share):.2f} | "
                    f"{min(share):.2f}-{max(share):.2f} |")
    print(f"{shape}: prepare/ceiling per round {', '.join(f'{x:.2f}' for x in ratios)}", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="conversations per shape")
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="data.preprocess_workers")
    parser.add_argument("--per-segment", action="store_true", help="also time prepare() with per-segment tokenization")
    args = parser.parse_args()
    os.environ.pop("TOKENIZERS_PARALLELISM", None)  # the ceiling uses every core; prepare's workers set their own

    import datasets  # noqa: F401  (imported up front: its ~2 s import is not preparation time)
    from transformers import AutoTokenizer

    from dsrecipes.paths import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        rows = []
        for shape in SHAPES if args.shape == "all" else [args.shape]:
            rows += bench_shape(shape, args, tmp, tokenizer)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{args.n:,} conversations per shape, tiny byte-level BPE tokenizer, chatml, cutoff 1024, "
          f"{args.workers} workers, {os.cpu_count()} CPUs, {args.rounds} rounds (load average at the end: "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})\n")
    print("| corpus | method | samples/s (median) | range | share of the ceiling (median) | range |")
    print("|---|---|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
