"""`dsrecipes prompt-eval`: a baseline and a fine-tuned model answer the same prompts, side by side.

In the style of DeepSpeed-Chat's step-1 `prompt_eval.py`: both models get each prompt through the same chat
template (the fine-tuned tokenizer's) and answer greedily. A score makes the comparison checkable: exact and
contains match against each prompt's `reference`, character similarity to it (difflib ratio, 0..1), and the mean
per-token loss of the reference answer under each model (lower is better). The last two move long before a tiny
model gets whole answers right.

A run directory works for either path: `--baseline RUN` means `RUN/export_init` (the seeded start of the embedded
tiny model, written at step 0), `--finetuned RUN` means `RUN/export`.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from dsrecipes.errors import UserError
from dsrecipes.paths import SAMPLE_DATA_DIR

DEFAULT_PROMPTS = SAMPLE_DATA_DIR / "prompts.jsonl"
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "</s>")


@dataclass
class Score:
    exact: int = 0
    contains: int = 0
    total: int = 0
    similarity: float = 0.0  # mean difflib ratio of answer and reference
    reference_loss: float = 0.0  # mean over prompts with a reference
    answers: List[str] = field(default_factory=list)


def model_dir(path: str, run_subdir: str) -> Path:
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return p
    if (p / run_subdir / "config.json").is_file():
        return p / run_subdir
    raise UserError(f"{path}: neither a Hugging Face model directory nor a run directory with {run_subdir}/")


def read_prompts(path: Path) -> List[Dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"--prompts: {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise UserError(f"{path}:{line_no}: each line needs a string 'prompt'")
            rows.append(row)
    if not rows:
        raise UserError(f"{path}: no prompts")
    return rows


def load_tokenizer(path: Path, chat_template: Optional[str] = None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if tokenizer.chat_template is None:
        raise UserError(f"{path}: the tokenizer has no chat_template, so prompts cannot be rendered as a chat")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def chat(row: Dict[str, Any]) -> List[Dict[str, str]]:
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return messages + [{"role": "user", "content": row["prompt"]}]


@torch.no_grad()
def evaluate_model(model: Any, tokenizer: Any, prompts: List[Dict[str, Any]], max_new_tokens: int) -> Score:
    score = Score()
    stop_ids = [tokenizer.eos_token_id] + [
        tokenizer.convert_tokens_to_ids(t) for t in END_OF_TURN_TOKENS if t in tokenizer.get_vocab()
    ]
    losses, similarities = [], []
    for row in prompts:
        rendered = tokenizer.apply_chat_template(chat(row), add_generation_prompt=True, tokenize=True, return_dict=True)
        prompt_ids = list(rendered["input_ids"])
        input_ids = torch.tensor([prompt_ids], device=model.device)
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(output[0, len(prompt_ids):], skip_special_tokens=True).strip()
        score.answers.append(answer)
        reference = row.get("reference")
        if reference is None:
            continue
        score.total += 1
        score.exact += normalize(answer) == normalize(reference)
        score.contains += normalize(reference) in normalize(answer)
        similarities.append(difflib.SequenceMatcher(None, normalize(answer), normalize(reference)).ratio())
        losses.append(reference_loss(model, tokenizer, prompt_ids, reference))
    score.reference_loss = sum(losses) / len(losses) if losses else float("nan")
    score.similarity = sum(similarities) / len(similarities) if similarities else float("nan")
    return score


def reference_loss(model: Any, tokenizer: Any, prompt_ids: List[int], reference: str) -> float:
    """Mean next-token loss of the reference answer (+ end of turn) after the rendered prompt."""
    answer_ids = tokenizer(reference, add_special_tokens=False)["input_ids"]
    eot = [t for t in END_OF_TURN_TOKENS if t in tokenizer.get_vocab()][:1]
    answer_ids += tokenizer.convert_tokens_to_ids(eot)
    ids = torch.tensor([prompt_ids + answer_ids], device=model.device)
    labels = torch.full_like(ids, -100)
    labels[0, len(prompt_ids):] = ids[0, len(prompt_ids):]
    return float(model(input_ids=ids, labels=labels, use_cache=False).loss)


def normalize(text: str) -> str:
    return " ".join(text.strip().casefold().split())


def print_side_by_side(prompts: List[Dict[str, Any]], scores: Dict[str, Score]) -> None:
    for i, row in enumerate(prompts):
        print(f"==========prompt {i + 1}/{len(prompts)}==========")
        print(row["prompt"])
        for name, score in scores.items():
            print(f"----------{name}: greedy----------")
            print(score.answers[i])
        if row.get("reference") is not None:
            print("----------reference----------")
            print(row["reference"])
        print()
    print("==========score==========")
    for name, score in scores.items():
        print(f"{name:<10} exact {score.exact}/{score.total}  contains {score.contains}/{score.total}  "
              f"similarity {score.similarity:.3f}  reference loss {score.reference_loss:.3f}")
