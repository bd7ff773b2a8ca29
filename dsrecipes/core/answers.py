"""How an answer is compared with a reference: exact match after normalisation (case-folded, whitespace collapsed).
prompt-eval after a run (serve/prompt_eval.py) and during training (rank/gen_eval.py) score with the same rule."""

from __future__ import annotations


def normalize(text: str) -> str:
    """An answer as exact match compares it: case-folded, whitespace collapsed."""
    return " ".join(text.strip().casefold().split())
