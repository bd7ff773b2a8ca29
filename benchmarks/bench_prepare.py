"""Speed of data preparation: ours vs a naive per-sample apply_chat_template loop vs raw batched tokenization.

    python benchmarks/bench_prepare.py --n 100000        # the full measurement (run it once: minutes on 2 cores)
    python benchmarks/bench_prepare.py --n 5000          # a quick look

Synthetic ShareGPT conversations (1-4 exchanges, long-tailed lengths, some system prompts and tool calls) are written
to a JSONL file and tokenized with the bundled tiny tokenizer and template=chatml (whose chat_template renders the
same text, so all three do the same work):

* naive: `tokenizer.apply_chat_template(messages, tokenize=True)` per sample (no labels even);
* raw batched: one fast-tokenizer call on the already rendered full texts (no rendering, no labels: a floor),
  through `tokenizer(texts)` and straight through the Rust `encode_batch_fast`;
* ours, encode: `Encoder.encode_batch` in chunks (render, batched per-segment tokenization, labels, truncation);
* ours, prepare: the whole `prepare()` from the JSONL file (read, check, encode, split, Arrow write), cold cache,
  with `data.preprocess_workers` 1 and 2; and the warm cache hit.
Prints a markdown table (samples/s, tokens/s, time, speed relative to naive).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two has look "
         "法国 首都 巴黎 天气 今天 多少 等于 加 减 转换 千米 米 单词 倒过来").split()


def synth_row(rng: random.Random, i: int) -> dict:
    def text(mean: float) -> str:
        n = max(1, min(400, int(rng.lognormvariate(mean, 0.9))))
        return " ".join(rng.choice(WORDS) for _ in range(n))

    turns = []
    for _ in range(rng.choice([1, 1, 2, 2, 3, 4])):
        turns.append({"from": "human", "value": text(2.5)})
        if rng.random() < 0.1:
            turns.append({"from": "function_call", "value": json.dumps({"name": "lookup", "arguments": {"q": text(1.0)}})})
            turns.append({"from": "observation", "value": json.dumps({"result": text(1.5)})})
        turns.append({"from": "gpt", "value": text(3.0)})
    row = {"id": f"bench-{i}", "conversations": turns}
    if rng.random() < 0.3:
        row["system"] = text(1.5)
    return row


def _sample_row_maker():
    """`make_row` of scripts/make_sample_data.py (not a package, so loaded from its file)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "make_sample_data.py"
    spec = importlib.util.spec_from_file_location("make_sample_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="conversations to generate")
    parser.add_argument("--cutoff", type=int, default=2048)
    parser.add_argument("--kind", choices=["long", "sample"], default="long",
                        help="long: synthetic chats of ~300 tokens (tokenizer-bound); sample: rows like the bundled "
                             "sample data, ~50 tokens (template-bound)")
    parser.add_argument("--naive-n", type=int, default=None, help="samples for the (slow) naive loop; default min(n, 20000)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    import datasets  # noqa: F401  (imported up front: its ~2 s import is not preparation time)
    from transformers import AutoTokenizer

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.badrows import BadRowReport
    from dsrecipes.data.prepare import prepare
    from dsrecipes.data.sharegpt import iter_conversations
    from dsrecipes.data.template import hf_messages
    from dsrecipes.data.tokenize import Encoder
    from dsrecipes.paths import TINY_TOKENIZER_DIR

    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    data = tmp / "bench.jsonl"
    rng = random.Random(0)
    make_row = synth_row if args.kind == "long" else _sample_row_maker()
    with open(data, "w", encoding="utf-8") as fh:
        for i in range(args.n):
            fh.write(json.dumps(make_row(rng, i), ensure_ascii=False) + "\n")
    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))

    def cfg_for(workers: int, cache: str):
        return compose_and_load([f"dataset.paths=[{data}]", "dataset.val_size=0", f"data.cutoff_len={args.cutoff}",
                                 f"data.preprocess_workers={workers}", f"data.cache_dir={cache}", "template=chatml"])

    cfg = cfg_for(1, str(tmp / "c0"))
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction)
    convs = list(iter_conversations(cfg.dataset, report=report))
    results = []

    # ours: encode only (render + tokenize + labels + truncation), in the chunk size prepare uses
    encoder = Encoder(tok, cfg)
    t = time.perf_counter()
    examples = []
    for s in range(0, len(convs), 512):
        examples += encoder.encode_batch(convs[s: s + 512])
    dt = time.perf_counter() - t
    tokens = sum(len(e.input_ids) for e in examples if e is not None)
    results.append(("ours: Encoder.encode_batch (render + tokenize + labels)", len(convs), tokens, dt))

    # raw batched: one tokenizer call on the full rendered texts (what tokenization alone costs)
    texts = [tok.apply_chat_template(hf_messages(c, cfg.template)[0], tools=hf_messages(c, cfg.template)[1], tokenize=False)
             for c in convs[: min(len(convs), 20000)]]
    texts = (texts * (len(convs) // len(texts) + 1))[: len(convs)]
    t = time.perf_counter()
    raw = tok(texts, add_special_tokens=False)["input_ids"]
    dt = time.perf_counter() - t
    results.append(("raw batched tokenizer(texts) on rendered text", len(texts), sum(map(len, raw)), dt))
    t = time.perf_counter()
    raw = tok.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    dt = time.perf_counter() - t
    results.append(("raw batched Rust encode_batch_fast(texts), ids only", len(texts), sum(len(e.ids) for e in raw), dt))

    # naive: apply_chat_template(tokenize=True) per sample
    naive_n = args.naive_n or min(len(convs), 20000)
    t = time.perf_counter()
    naive_tokens = 0
    for c in convs[:naive_n]:
        messages, tools = hf_messages(c, cfg.template)
        out = tok.apply_chat_template(messages, tools=tools, tokenize=True)
        naive_tokens += len(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    dt = time.perf_counter() - t
    results.append((f"naive per-sample apply_chat_template (first {naive_n})", naive_n, naive_tokens, dt))

    # ours: the whole prepare() from the file, cold cache, 1 and 2 workers; then a cache hit
    for workers in (1, 2):
        c = cfg_for(workers, str(tmp / f"cache{workers}"))
        t = time.perf_counter()
        prep = prepare(c, tok, tmp / f"run{workers}")
        dt = time.perf_counter() - t
        results.append((f"ours: prepare() end to end, cold, preprocess_workers={workers}", args.n, prep.stats["tokens"], dt))
    t = time.perf_counter()
    prep = prepare(cfg_for(2, str(tmp / "cache2")), tok, tmp / "run-hit")
    results.append(("ours: prepare() cache hit", args.n, prep.stats["tokens"], time.perf_counter() - t))

    naive = next(r for r in results if r[0].startswith("naive"))
    naive_rate = naive[1] / naive[3]
    print(f"\n{args.n} {args.kind} conversations, {tokens} tokens (tiny tokenizer, chatml, cutoff {args.cutoff}), "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}\n")
    print("| method | samples | samples/s | tokens/s | seconds | vs naive |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, n, toks, dt in results:
        print(f"| {name} | {n} | {n / dt:,.0f} | {toks / dt:,.0f} | {dt:.2f} | {n / dt / naive_rate:.1f}x |")


if __name__ == "__main__":
    main()
