"""Preparation of prompt rows (`rows=prompt`, `data=map`): read and tokenize prompts, split, mix, write Arrow.

The order of operations of pair preparation (pairs.py): sources in order with their caps and the bad-row policy,
the seeded validation split, per-source mixing weights (copy k >= 1 gets the id `<id>@<k>`), one Arrow dataset per
split. The stats keep the keys of SFT preparation (`prepare_stats.summary`, `inspect-data`), counted in prompts;
nothing is trained on a prompt's tokens, so "trained tokens" are 0.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Sequence

from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.data.prepare.pairs import build_rows
from dsrecipes.data.render.prompt_encode import read_and_encode_prompts
from dsrecipes.data.sources.badrows import BadRowReport

COLUMNS = ("ids", "prompt_ids", "reference")


def build(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig], val: Sequence[SourceConfig],
          report: BadRowReport, out: Path) -> Dict[str, Any]:
    """Write `out/train` (and `out/val`); returns the preparation's stats (`val` as in pairs.build)."""
    return build_rows(cfg, tokenizer, sources, val, report, out, read_and_encode_prompts, _stats, "prompts",
                      lambda rows: COLUMNS)


def _stats(cfg: TrainConfig, report: BadRowReport, rows: List[Dict[str, Any]], names: List[str], n_train: int,
           n_val: int) -> Dict[str, Any]:
    lengths = sorted(len(r["prompt_ids"]) for r in rows)
    return {
        "row_kind": cfg.objective.rows.value, "dataset": cfg.dataset.name, "template": cfg.template.name.value,
        "train_on": "none", "cutoff_len": cfg.data.cutoff_len, "packing": cfg.data.packing,
        "rows_read": report.rows_read, "rows_kept": len(rows), "skipped": dict(sorted(report.counts.items())),
        "skipped_total": report.skipped, "skipped_by_file": report.files(), "trailing_turns_dropped": 0,
        "truncated": 0, "truncated_share": 0.0, "dropped_all_trained_cut": 0,
        "duplicate_ids": sum(n - 1 for n in Counter(r["ids"][0] for r in rows).values() if n > 1),
        "samples": {"train": n_train, "val": n_val}, "rows": {"train": 0, "val": 0},
        "tokens": sum(lengths), "trained_tokens": 0, "trained_token_share": 0.0,
        "length": {"mean": sum(lengths) / len(lengths), "p50": lengths[len(lengths) // 2],
                   "p95": lengths[int(len(lengths) * 0.95)], "max": lengths[-1], "histogram": []},
        "packing_efficiency": {"train": None, "val": None},
        "sources": {name: {"conversations": n, "train_samples": 0} for name, n in Counter(names).items()},
        "with_reference": sum(1 for r in rows if r["reference"]),
    }
