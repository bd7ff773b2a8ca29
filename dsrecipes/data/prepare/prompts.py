"""Prompt rows' entry in the preparation table (`rows=prompt`, `data=map`; build.py `PREPARATIONS`): how they are
read, which columns they keep, what their stats count. Everything else is the preparation of pairs (pairs.py): the
same builder, the seeded validation split, per-source mixing weights, one Arrow dataset per split. Nothing is trained
on a prompt's tokens, so "trained tokens" are 0.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.data.prepare.pairs import Items, SampleRows, sample_stats
from dsrecipes.data.render.prompt_encode import read_and_encode_prompts
from dsrecipes.data.sources.badrows import BadRowReport

PROMPT_COLUMNS = ("ids", "prompt_ids", "reference")


def read_prompts(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig], report: BadRowReport) -> SampleRows:
    return SampleRows(*read_and_encode_prompts(cfg, tokenizer, sources, report))


def prompt_columns(rows: List[Dict[str, Any]]) -> Sequence[str]:
    return PROMPT_COLUMNS


def prompt_stats(cfg: TrainConfig, sources: Sequence[SourceConfig], report: BadRowReport, data: SampleRows,
                 train_items: Items, val_items: Items) -> Dict[str, Any]:
    lengths = [len(r["prompt_ids"]) for r in data.rows]
    return sample_stats(cfg, report, data, train_items, val_items, train_on="none", truncated=0, tokens=sum(lengths),
                        trained=0, lengths=lengths, with_reference=sum(1 for r in data.rows if r["reference"]))
