"""Preparation of prompt rows (`rows=prompt`, `data=map`): read and tokenize prompts, split, mix, write Arrow.

The order of operations of pair preparation (pairs.py): sources in order with their caps and the bad-row policy,
the seeded validation split, per-source mixing weights (copy k >= 1 gets the id `<id>@<k>`), one Arrow dataset per
split. The stats keep the keys of SFT preparation (`prepare_stats.summary`, `inspect-data`), counted in prompts;
nothing is trained on a prompt's tokens, so "trained tokens" are 0.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Sequence

from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.data.render.prompt_encode import read_and_encode_prompts
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.splits import split_and_mix

COLUMNS = ("ids", "prompt_ids", "reference")


def build(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig], val: Sequence[SourceConfig],
          report: BadRowReport, out: Path) -> Dict[str, Any]:
    """Write `out/train` (and `out/val`); returns the preparation's stats (`val` as in pairs.build)."""
    from datasets import Dataset

    rows, names = read_and_encode_prompts(cfg, tokenizer, sources, report)
    trained = len(rows)
    if val:
        uncapped = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, max_samples=None))
        more, more_names = read_and_encode_prompts(uncapped, tokenizer, val, report)
        rows, names = rows + more, names + more_names
    report.check()
    if not trained:
        raise DataError(f"dataset {cfg.dataset.name}: no usable prompts ({report.summary()})")
    train_items, val_items = split_and_mix(range(trained), range(trained, len(rows)), names,
                                           {src.name: src.weight for src in sources}, cfg.dataset.val_size,
                                           cfg.trainer.seed)
    stats = _stats(cfg, report, rows, names, len(train_items), len(val_items))
    for name, n in Counter(names[i] for i, _ in train_items).items():
        stats["sources"][name]["train_samples"] = n
    for split, items in (("train", train_items), ("val", val_items)):
        if not items:
            continue
        table = {c: [_copy(rows[i], c, k) for i, k in items] for c in COLUMNS}
        Dataset.from_dict(table).save_to_disk(str(out / split))
        stats["rows"][split] = len(items)
    return stats


def _copy(row: Dict[str, Any], column: str, copy: int) -> Any:
    if column == "ids" and copy:
        return [f"{row['ids'][0]}@{copy}"]
    return row[column]


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
