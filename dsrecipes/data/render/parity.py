"""Train/serve token parity of prepared rows: does serving tokenize each reply's prompt as training did?

Serving (`dsrecipes chat`, an exported chat_template through `apply_chat_template`, plain `generate`) tokenizes the
whole prompt before a reply as one text. Training tokenizes the whole conversation once where it can (spans.py) and
per segment where it cannot (a token straddling a segment border, a text too long); a template whose prompt ends
where a tokenizer glues the next word on (a trailing space or "\\n\\n" with a GPT-2 pre-tokenizer) can make the two
differ. `split_report` decodes the tokens before every reply of the first rows, tokenizes that text as serving does
and counts where the ids differ, with the first such place, so `inspect-data` shows it before any training.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple

from dsrecipes.data.render.labels import IGNORE_INDEX

WINDOW = 4  # tokens shown on each side of the first difference


def reply_prompts(row: Mapping[str, Any]) -> List[List[int]]:
    """The token ids before each reply of a prepared row (a packed row: per sample; a pair or prompt row: its
    prompt)."""
    if "prompt_ids" in row:
        return [list(row["prompt_ids"])]
    ids, labels, positions = list(row["input_ids"]), list(row["labels"]), list(row["position_ids"])
    starts = [i for i, p in enumerate(positions) if p == 0] or [0]
    out = []
    for lo, hi in zip(starts, starts[1:] + [len(ids)]):
        out += [ids[lo:i] for i in range(lo + 1, hi)
                if labels[i] != IGNORE_INDEX and labels[i - 1] == IGNORE_INDEX]
    return out


def split_report(rows: Iterable[Mapping[str, Any]], tokenizer: Any, limit: int = 200) -> str:
    """One line (two with an example): how many reply prompts of the first `limit` rows serving tokenizes as
    training did."""
    checked, differ, first = 0, 0, None
    for n, row in enumerate(rows):
        if n >= limit:
            break
        for prompt in reply_prompts(row):
            text = tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            served = tokenizer(text, add_special_tokens=False)["input_ids"]
            checked += 1
            if served != prompt:
                differ += 1
                first = first or _first_difference(tokenizer, prompt, served)
    line = (f"train/serve tokens: {checked - differ} of {checked} reply prompts (first {limit} rows) tokenize as "
            "serving does (the prompt as one text)")
    if not differ:
        return line
    return (f"{line}; {differ} DIFFER: the model trains on tokens it will not see at inference (try another "
            f"template or template.name=tokenizer). First: training {first[0]} vs serving {first[1]}")


def _first_difference(tokenizer: Any, trained: Sequence[int], served: Sequence[int]) -> Tuple[List[str], List[str]]:
    k: Optional[int] = next((i for i, (a, b) in enumerate(zip(trained, served)) if a != b), None)
    k = min(len(trained), len(served)) if k is None else k
    lo = max(0, k - WINDOW)
    return (tokenizer.convert_ids_to_tokens(list(trained[lo: k + WINDOW])),
            tokenizer.convert_ids_to_tokens(list(served[lo: k + WINDOW])))
