"""Write dsrecipes/assets/sample_data/pairs.jsonl: preference pairs in LLaMA-Factory's ShareGPT ranking format, built
from the bundled SFT sample data (train.jsonl): for every conversation whose final answer holds a number, the prompt
is the conversation before that answer, `chosen` the answer, `rejected` the answer with its last number changed.
Deterministic: `python scripts/make_sample_pairs.py` rewrites the same file."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data"
NUMBER = re.compile(r"\d+")


def corrupt(text: str, rng: random.Random) -> str:
    last = list(NUMBER.finditer(text))[-1]
    wrong = int(last.group()) + rng.choice([-3, -2, -1, 1, 2, 3, 10])
    return text[:last.start()] + str(abs(wrong)) + text[last.end():]


def main() -> None:
    rng = random.Random(0)
    out = []
    for n, line in enumerate((SAMPLE / "train.jsonl").read_text(encoding="utf-8").splitlines()):
        row = json.loads(line)
        *prompt, answer = row["conversations"]
        if answer["from"] != "gpt" or not NUMBER.search(answer["value"]):
            continue
        rejected = corrupt(answer["value"], rng)
        if rejected == answer["value"]:
            continue
        pair = {"id": row.get("id", f"train.jsonl:{n + 1}"), "conversations": prompt,
                "chosen": {"from": "gpt", "value": answer["value"]}, "rejected": {"from": "gpt", "value": rejected}}
        pair.update({k: row[k] for k in ("system", "tools") if k in row})
        out.append(json.dumps(pair, ensure_ascii=False))
    (SAMPLE / "pairs.jsonl").write_text("\n".join(out) + "\n", encoding="utf-8")
    info = {"sample_pairs": {"file_name": "pairs.jsonl", "formatting": "sharegpt", "ranking": True,
                             "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                         "system": "system", "tools": "tools"}}}
    (SAMPLE / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(f"{len(out)} pairs -> {SAMPLE / 'pairs.jsonl'}")


if __name__ == "__main__":
    main()
