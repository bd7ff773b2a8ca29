"""Write dsrecipes/assets/sample_data/pairs.jsonl: preference pairs in LLaMA-Factory's ShareGPT ranking format, built
from the bundled SFT sample data (train.jsonl): for every conversation whose final answer holds a number, the prompt
is the conversation before that answer, `chosen` the answer, `rejected` the answer with its last number changed.
Also prompt_rows.jsonl, prompt rows for online RL (`objective=grpo dataset=sample_prompts`): the single-turn prompts
without tools of those pairs, the answer as `reference` (short enough for debug=fast's cutoff less the completion).
Deterministic: `python scripts/make_sample_pairs.py` rewrites the same files."""

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


def prompt_row(pair: dict) -> dict | None:
    """A pair's prompt as a prompt row with its chosen answer as the reference; None for a tool or multi-turn one."""
    if len(pair["conversations"]) != 1 or "tools" in pair:
        return None
    row = {"id": pair["id"], "conversations": pair["conversations"], "reference": pair["chosen"]["value"]}
    return {**row, **({"system": pair["system"]} if "system" in pair else {})}


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
    prompts = [json.dumps(row, ensure_ascii=False) for row in map(prompt_row, map(json.loads, out)) if row]
    (SAMPLE / "prompt_rows.jsonl").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    info = {"sample_pairs": {"file_name": "pairs.jsonl", "formatting": "sharegpt", "ranking": True,
                             "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                                         "system": "system", "tools": "tools"}},
            "sample_prompts": {"file_name": "prompt_rows.jsonl", "formatting": "sharegpt",
                               "columns": {"messages": "conversations", "system": "system"}}}
    (SAMPLE / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(f"{len(out)} pairs -> {SAMPLE / 'pairs.jsonl'}, {len(prompts)} prompts -> {SAMPLE / 'prompt_rows.jsonl'}")


if __name__ == "__main__":
    main()
