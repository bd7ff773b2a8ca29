"""A deterministic synthetic ShareGPT corpus of a requested size, for the benchmarks (not a benchmark itself).

Owner: benchmarks/. `write_corpus(root, mb, files)` writes `files` JSONL files (uneven sizes, together at least `mb`
MiB) of conversations shaped like tool-call chat data: 1-4 user/assistant exchanges, a system prompt on ~30% of rows,
a function call and its observation (JSON strings) on ~15% of exchanges, ~8% CJK words, long-tailed turn lengths
(~1.5 KB per row on average). The same (mb, files, seed) always gives the same bytes: a seeded `random.Random`,
texts cut from one seeded word stream (~25 MB/s on the 2-core test machine: a 256 MB corpus in ~10 s). Nothing is
read from outside the repository.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List

WORDS = ("the a of to and in is it you that was for on are with as they be at one have this from or had by word but "
         "what some we can out other were all there when up use your how said an each which do their time if will "
         "way about many then them write would like so these her long make thing see two has look more day could go "
         "come number sound most people over know water than call first who may down side been now find any new "
         "work part take get place made live where after back little only round man year came show every good me "
         "give our under name very through just form sentence great think say help low line differ turn cause much "
         "mean before move right boy old too same tell does set three want air well also play small end put home "
         "read hand port large spell add even land here must big high such follow act why ask men change went light "
         "kind off need house picture try us again animal point mother world near build self earth father").split()
CJK = "法国 首都 巴黎 天气 今天 多少 等于 转换 千米 单词 倒过来 数据 模型 训练 问题 回答".split()
FUNCTIONS = ("get_weather", "convert_currency", "search_flights", "calculate_loan", "lookup_stock", "translate_text")


def _stream(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(CJK) if rng.random() < 0.08 else rng.choice(WORDS) for _ in range(words))


class _Texts:
    """Texts of a given length cut from one seeded stream of words (fast: no per-word work per row)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.text = _stream(rng, 400_000)  # ~2 MB of words

    def cut(self, chars: int) -> str:
        start = self.text.find(" ", self.rng.randrange(len(self.text) - chars - 64)) + 1
        end = self.text.rfind(" ", start, start + chars + 1)
        return self.text[start:end if end > start else start + chars]

    def turn(self, mean: float) -> str:
        return self.cut(max(8, min(6000, int(self.rng.lognormvariate(mean, 0.9)))))


def make_row(texts: _Texts, i: int) -> dict:
    rng = texts.rng
    turns = []
    for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
        turns.append({"from": "human", "value": texts.turn(4.3)})
        if rng.random() < 0.15:
            name = rng.choice(FUNCTIONS)
            call = {"name": name, "arguments": {"query": texts.cut(rng.randint(10, 60)), "limit": rng.randint(1, 20)}}
            turns.append({"from": "function_call", "value": json.dumps(call, ensure_ascii=False)})
            result = {"result": texts.cut(rng.randint(40, 400)), "status": "ok"}
            turns.append({"from": "observation", "value": json.dumps(result, ensure_ascii=False)})
        turns.append({"from": "gpt", "value": texts.turn(5.6)})
    row = {"id": f"row{i}", "conversations": turns}
    if rng.random() < 0.3:
        row["system"] = texts.turn(4.0)
    return row


def write_corpus(root: Path, mb: float, files: int, seed: int = 0) -> List[Path]:
    """`files` JSONL files under `root` (created), `mb` MiB in all (each file stops at the first row past its share;
    shares uneven: weights 0.5-1.5). Returns their paths."""
    rng = random.Random(seed)
    texts = _Texts(rng)
    weights = [rng.uniform(0.5, 1.5) for _ in range(files)]
    root.mkdir(parents=True, exist_ok=True)
    paths, n = [], 0
    for f, weight in enumerate(weights):
        path, size, target = root / f"part{f:02d}.jsonl", 0, int(mb * (1 << 20) * weight / sum(weights))
        with open(path, "w", encoding="utf-8") as fh:
            while size < target:
                line = json.dumps(make_row(texts, n), ensure_ascii=False) + "\n"
                fh.write(line)
                size += len(line.encode("utf-8"))
                n += 1
        paths.append(path)
    return paths
