"""Prompt rows' entry in the preparation table (`rows=prompt`, `data=map`; build.py `PREPARATIONS`): how they are
read, which columns they keep, what their stats count. Everything else is the preparation of pairs (pairs.py): the
same builder, the seeded validation split, per-source mixing weights, one Arrow dataset per split. Nothing is trained
on a prompt's tokens, so "trained tokens" are 0.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Sequence

from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.data.prepare.pairs import Items, SampleRows, sample_stats
from dsrecipes.data.render.prompt_encode import read_and_encode_prompts
from dsrecipes.data.sources.badrows import BadRowReport

PROMPT_COLUMNS = ("ids", "prompt_ids", "reference")
REFERENCE_REWARDS = ("exact_match", "number_equal")  # the built-in rewards that compare with a row's reference


def read_prompts(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig], report: BadRowReport) -> SampleRows:
    return SampleRows(*read_and_encode_prompts(cfg, tokenizer, sources, report))


def prompt_columns(rows: List[Dict[str, Any]]) -> Sequence[str]:
    return PROMPT_COLUMNS


def prompt_stats(cfg: TrainConfig, sources: Sequence[SourceConfig], report: BadRowReport, data: SampleRows,
                 train_items: Items, val_items: Items) -> Dict[str, Any]:
    lengths = [len(r["prompt_ids"]) for r in data.rows]
    return sample_stats(cfg, report, data, train_items, val_items, train_on="none", truncated=0, tokens=sum(lengths),
                        trained=0, lengths=lengths, with_reference=sum(1 for r in data.rows if r["reference"]))


def reference_lines(cfg: TrainConfig, stats: Dict[str, Any]) -> List[str]:
    """Prompt rows without a reference answer (columns `reference`, `answer`, `solution`), said where a configured
    reward compares with it (exact_match, number_equal: 0 for every completion of such a row). DataError when no row
    has one and every reward is such a comparison: every completion would score 0, so nothing would be learnt."""
    rows, refs = stats.get("rows_kept", 0), stats.get("with_reference")
    needing = [r.name for r in cfg.objective.rewards if r.name in REFERENCE_REWARDS]
    if refs is None or refs >= rows or not needing:
        return []
    said = (f"{rows - refs} of {rows} prompt rows have no reference answer (a `reference`, `answer` or `solution` "
            f"column), and objective.rewards {', '.join(needing)} compare{'s' if len(needing) == 1 else ''} the "
            "completion with it: every completion of such a row scores 0 there")
    if refs == 0 and len(needing) == len(cfg.objective.rewards) and not cfg.objective.reward_model:
        raise DataError(f"objective.rewards: {said}, so no completion would ever score and the run would learn "
                        "nothing. Add the reference answers to the rows, or use a reward that needs none "
                        "({name: regex, pattern: ...}, {name: length, ...}, an installed function, or "
                        "objective.reward_model=DIR)")
    return [f"note: {said}"]


def say_references(cfg: TrainConfig, rows: int, without: int) -> None:
    """`reference_lines` of `rows` prompt rows, `without` of them lacking a reference (a stream's pre-scan, a shard's
    manifest), printed on stderr; DataError as there."""
    for line in reference_lines(cfg, {"rows_kept": rows, "with_reference": rows - without}):
        print(line, file=sys.stderr)
