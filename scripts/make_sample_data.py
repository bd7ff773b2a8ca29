"""Write the bundled sample data: dsrecipes/assets/sample_data/{train.jsonl,prompts.jsonl}.

Deterministic (seeded) ShareGPT conversations in English and Chinese about tasks a ~1M-parameter model visibly learns
in a minute or two of CPU training: small-number arithmetic, unit conversion from a fixed table, reversing short
words, capital-city lookups from a fixed table, and tool calls (function_call JSON -> observation -> answer).
Answers are short and formulaic on purpose, so the loss falls clearly.

The rows exercise the loader too: roles human/gpt/system/function_call/observation, a `system` field on some rows,
a leading system turn on others, a `tools` JSON string on tool rows, and an `id` on some rows only.

    python scripts/make_sample_data.py [--n 3000] [--seed 1234] [--out dsrecipes/assets/sample_data]

`prompts.jsonl` holds held-out prompts for prompt-eval ({"prompt", "reference"}): arithmetic pairs and conversion
values that never occur in train.jsonl, plus capital questions (facts seen in training, in a new turn position).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data"

CAPITALS = [  # country (en, zh), capital (en, zh)
    ("France", "法国", "Paris", "巴黎"),
    ("Japan", "日本", "Tokyo", "东京"),
    ("Italy", "意大利", "Rome", "罗马"),
    ("Spain", "西班牙", "Madrid", "马德里"),
    ("Germany", "德国", "Berlin", "柏林"),
    ("Egypt", "埃及", "Cairo", "开罗"),
    ("Canada", "加拿大", "Ottawa", "渥太华"),
    ("Kenya", "肯尼亚", "Nairobi", "内罗毕"),
    ("Peru", "秘鲁", "Lima", "利马"),
    ("Norway", "挪威", "Oslo", "奥斯陆"),
    ("China", "中国", "Beijing", "北京"),
    ("Russia", "俄罗斯", "Moscow", "莫斯科"),
]

UNITS = [  # from (en, zh), to (en, zh), factor
    ("km", "千米", "m", "米", 1000),
    ("m", "米", "cm", "厘米", 100),
    ("kg", "千克", "g", "克", 1000),
    ("hours", "小时", "minutes", "分钟", 60),
    ("minutes", "分钟", "seconds", "秒", 60),
    ("days", "天", "hours", "小时", 24),
]

WORDS = [
    "cat", "dog", "sun", "tree", "book", "milk", "star", "bird", "fish", "rain", "moon", "lamp", "door", "road",
    "ship", "cake", "frog", "ring", "wolf", "gold", "desk", "leaf", "snow", "wind", "rock", "seed", "corn", "salt",
]

WEATHER = {  # city -> (condition en, condition zh, temperature C): the "observation" of the weather tool
    "Paris": ("sunny", "晴天", 21), "Tokyo": ("rainy", "下雨", 17), "Rome": ("cloudy", "多云", 24),
    "Berlin": ("windy", "刮大风", 12), "Cairo": ("sunny", "晴天", 33), "Oslo": ("snowy", "下雪", -3),
    "Lima": ("cloudy", "多云", 19), "Beijing": ("sunny", "晴天", 26),
}
CITY_ZH = {"Paris": "巴黎", "Tokyo": "东京", "Rome": "罗马", "Berlin": "柏林", "Cairo": "开罗", "Oslo": "奥斯陆",
           "Lima": "利马", "Beijing": "北京"}

TOOLS = [  # compact schemas: tool rows must fit the 128-token rows of `debug=fast`
    {"name": "get_weather", "description": "weather of a city", "parameters": {"city": "string"}},
    {"name": "add", "description": "add two integers", "parameters": {"a": "integer", "b": "integer"}},
]

SYSTEMS_EN = ["You are a helpful assistant.", "You are a concise assistant. Answer in one sentence."]
SYSTEMS_ZH = ["你是一个有用的助手。", "你是一个简洁的助手，用一句话回答。"]

# Held out of train.jsonl so prompt-eval asks questions the model has not memorised verbatim.
HELD_OUT_ADD = {(7, 8), (12, 9), (23, 14), (5, 16)}
HELD_OUT_SUB = {(17, 9)}
HELD_OUT_CONV = {(3, "km"), (7, "kg"), (4, "hours")}


def _arith(rng: random.Random, zh: bool) -> tuple[str, str]:
    while True:
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        op = rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        if (a, b) not in (HELD_OUT_ADD if op == "+" else HELD_OUT_SUB):
            break
    c = a + b if op == "+" else a - b
    if zh:
        word = "加" if op == "+" else "减"
        return f"{a} {word} {b} 等于多少？", f"{a} {op} {b} = {c}。"
    return rng.choice([f"What is {a} {op} {b}?", f"Compute {a} {op} {b}."]), f"{a} {op} {b} = {c}."


def _convert(rng: random.Random, zh: bool) -> tuple[str, str]:
    while True:
        src, src_zh, dst, dst_zh, factor = rng.choice(UNITS)
        n = rng.randint(1, 12)
        if (n, src) not in HELD_OUT_CONV:
            break
    if zh:
        return f"{n} {src_zh}是多少{dst_zh}？", f"{n} {src_zh} = {n * factor} {dst_zh}。"
    return f"Convert {n} {src} to {dst}.", f"{n} {src} = {n * factor} {dst}."


def _reverse(rng: random.Random, zh: bool) -> tuple[str, str]:
    word = rng.choice(WORDS)
    if zh:
        return f"把单词 {word} 倒过来写。", f"{word[::-1]}"
    return f"Reverse the word '{word}'.", f"{word[::-1]}"


def _capital(rng: random.Random, zh: bool) -> tuple[str, str]:
    country, country_zh, city, city_zh = rng.choice(CAPITALS)
    if zh:
        return f"{country_zh}的首都是哪里？", f"{country_zh}的首都是{city_zh}。"
    return f"What is the capital of {country}?", f"The capital of {country} is {city}."


SIMPLE_TASKS = [_arith, _convert, _reverse, _capital]


def _tool_turns(rng: random.Random, zh: bool) -> tuple[list[dict], dict]:
    """The turns of one tool call, and the schema of the tool it uses (rows list only that tool, to stay short)."""
    if rng.random() < 0.5:
        tool = TOOLS[0]
        city = rng.choice(sorted(WEATHER))
        cond, cond_zh, temp = WEATHER[city]
        call = {"name": "get_weather", "arguments": {"city": city}}
        obs = {"city": city, "condition": cond, "temp": temp}
        if zh:
            ask, answer = f"{CITY_ZH[city]}现在天气怎么样？", f"{CITY_ZH[city]}现在{cond_zh}，气温 {temp}°C。"
        else:
            ask, answer = f"What's the weather in {city}?", f"It is {cond} in {city}, {temp}°C."
    else:
        tool = TOOLS[1]
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        call = {"name": "add", "arguments": {"a": a, "b": b}}
        obs = {"result": a + b}
        ask = f"请用工具计算 {a} 加 {b}。" if zh else f"Use the tool to add {a} and {b}."
        answer = f"{a} + {b} = {a + b}。" if zh else f"{a} + {b} = {a + b}."
    return [
        {"from": "human", "value": ask},
        {"from": "function_call", "value": json.dumps(call, ensure_ascii=False)},
        {"from": "observation", "value": json.dumps(obs, ensure_ascii=False)},
        {"from": "gpt", "value": answer},
    ], tool


def make_row(rng: random.Random, index: int) -> dict:
    zh = rng.random() < 0.35
    is_tool = rng.random() < 0.2
    turns: list[dict] = []
    tool = None
    for k in range(rng.choice([1, 1, 2] if is_tool else [1, 1, 1, 2, 2, 3])):
        if is_tool and k == 0:
            tool_turns, tool = _tool_turns(rng, zh)
            turns += tool_turns
        else:
            q, a = rng.choice(SIMPLE_TASKS)(rng, zh)
            turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    row: dict = {}
    if index % 3 == 0:
        row["id"] = f"sample-{index:05d}"
    system = rng.choice(SYSTEMS_ZH if zh else SYSTEMS_EN)
    style = rng.random()
    if style < 0.25:
        row["system"] = system
    elif style < 0.4:
        turns.insert(0, {"from": "system", "value": system})
    row["conversations"] = turns
    if tool is not None:
        row["tools"] = json.dumps([tool], ensure_ascii=False)
    return row


def make_prompts() -> list[dict]:
    prompts = []
    for a, b in sorted(HELD_OUT_ADD):
        prompts.append({"prompt": f"What is {a} + {b}?", "reference": f"{a} + {b} = {a + b}."})
    for a, b in sorted(HELD_OUT_SUB):
        prompts.append({"prompt": f"{a} 减 {b} 等于多少？", "reference": f"{a} - {b} = {a - b}。"})
    factors = {u[0]: u for u in UNITS}
    for n, src in sorted(HELD_OUT_CONV):
        _, src_zh, dst, dst_zh, factor = factors[src]
        prompts.append({"prompt": f"Convert {n} {src} to {dst}.", "reference": f"{n} {src} = {n * factor} {dst}."})
    prompts.append({"prompt": "What is the capital of Norway?", "reference": "The capital of Norway is Oslo."})
    prompts.append({"prompt": "日本的首都是哪里？", "reference": "日本的首都是东京。"})
    prompts.append({"prompt": "Reverse the word 'star'.", "reference": "rats"})
    prompts.append({"prompt": "Reverse the word 'lamp'.", "reference": "pmal"})
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="number of conversations")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "train.jsonl", "w", encoding="utf-8", newline="\n") as fh:
        for i in range(args.n):
            fh.write(json.dumps(make_row(rng, i), ensure_ascii=False) + "\n")
    with open(args.out / "prompts.jsonl", "w", encoding="utf-8", newline="\n") as fh:
        for p in make_prompts():
            fh.write(json.dumps(p, ensure_ascii=False) + "\n")
    size = (args.out / "train.jsonl").stat().st_size
    print(f"wrote {args.n} conversations ({size / 1e6:.2f} MB) and {len(make_prompts())} prompts to {args.out}")


if __name__ == "__main__":
    main()
