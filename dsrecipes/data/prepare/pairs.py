"""Preparation of rows that are one sample each (pairs: `rows=pair`; prompts: `rows=prompt`, prompts.py), `data=map`.

build.py prepares every row kind with one builder (`build.build_split`); this module gives it what these row kinds
share: `SampleRows` (the rows as read, one per sample, all usable), `write_rows` (one Arrow dataset per split, no
packing: a pair's two sequences are its own micro-batch rows), `sample_stats` (the keys of SFT preparation,
`prepare_stats.summary`, `inspect-data`, counted in samples), and the pairs' own entry (`read_pairs`, `pair_stats`,
`PAIR_COLUMNS`): "trained tokens" are the answers' tokens on both sides. Also the reference log-probs of prepared
pairs (`attach_reference`, `reference_key`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.core.publish import Existing, publish_dir, staging_dir
from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.prepare.cache import content_hashes
from dsrecipes.data.prepare.cache_contents import check, seal
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.preference_encode import read_and_encode_pairs
from dsrecipes.data.sources.badrows import BadRowReport

PAIR_COLUMNS = ("ids", "prompt_ids", "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")
Items = List[Tuple[int, int]]  # (sample index, copy number)


@dataclass
class SampleRows:
    """Pairs or prompts as read: one row (its columns) per sample, every one usable, and each one's source name."""

    rows: List[Dict[str, Any]]
    sources: List[str]

    @property
    def kept(self) -> np.ndarray:
        return np.arange(len(self.rows))

    def join(self, more: "SampleRows") -> "SampleRows":
        return SampleRows(self.rows + more.rows, self.sources + more.sources)


def read_pairs(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig], report: BadRowReport) -> SampleRows:
    return SampleRows(*read_and_encode_pairs(cfg, tokenizer, sources, report))


def pair_columns(rows: List[Dict[str, Any]]) -> Sequence[str]:
    return PAIR_COLUMNS + (("margin",) if any(r.get("margin") is not None for r in rows) else ())


def write_rows(columns_of: Any, out: Path, items: Items, data: SampleRows, cfg: TrainConfig,
               tag: str) -> Tuple[int, Optional[float]]:
    """One split as an Arrow dataset with the `columns_of(rows)`; (rows written, packing efficiency: none)."""
    from datasets import Dataset

    table = {c: [_copy(data.rows[i], c, k) for i, k in items] for c in columns_of(data.rows)}
    Dataset.from_dict(table).save_to_disk(str(out))
    return len(items), None


def _copy(row: Dict[str, Any], column: str, copy: int) -> Any:
    if column == "ids" and copy:
        return [f"{row['ids'][0]}@{copy}"]
    return row.get(column)  # (a pair's margin: None where it has none)


def sample_stats(cfg: TrainConfig, report: BadRowReport, data: SampleRows, train_items: Items, val_items: Items, *,
                 train_on: str, truncated: int, tokens: int, trained: int, lengths: List[int],
                 **extra: Any) -> Dict[str, Any]:
    """`prepare_stats.json` of rows that are one sample each (the kind's own counts as arguments)."""
    rows, lengths = data.rows, sorted(lengths)
    per_source = {name: {"conversations": n, "train_samples": 0} for name, n in Counter(data.sources).items()}
    for name, n in Counter(data.sources[i] for i, _ in train_items).items():  # the summary's per-source line
        per_source[name]["train_samples"] = n
    return {
        "row_kind": cfg.objective.rows.value, "dataset": cfg.dataset.name, "template": cfg.template.name.value,
        "train_on": train_on, "cutoff_len": cfg.data.cutoff_len, "packing": cfg.data.packing,
        "rows_read": report.rows_read, "rows_kept": len(rows), "skipped": dict(sorted(report.counts.items())),
        "skipped_total": report.skipped, "skipped_by_file": report.files(), "trailing_turns_dropped": 0,
        "truncated": truncated, "truncated_share": truncated / len(rows), "dropped_all_trained_cut": 0,
        "duplicate_ids": sum(n - 1 for n in Counter(r["ids"][0] for r in rows).values() if n > 1),
        "samples": {"train": len(train_items), "val": len(val_items)}, "rows": {"train": 0, "val": 0},
        "tokens": tokens, "trained_tokens": trained, "trained_token_share": trained / tokens if tokens else 0.0,
        "length": {"mean": sum(lengths) / len(lengths), "p50": lengths[len(lengths) // 2],
                   "p95": lengths[int(len(lengths) * 0.95)], "max": lengths[-1], "histogram": []},
        "packing_efficiency": {"train": None, "val": None}, "sources": per_source, **extra,
    }


def pair_stats(cfg: TrainConfig, sources: Sequence[SourceConfig], report: BadRowReport, data: SampleRows,
               train_items: Items, val_items: Items) -> Dict[str, Any]:
    rows = data.rows
    return sample_stats(
        cfg, report, data, train_items, val_items, train_on="last_assistant",
        truncated=sum(bool(r["truncated"]) for r in rows),
        tokens=sum(len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows),
        trained=sum(sum(lab != IGNORE_INDEX for lab in r[f"{side}_labels"]) for r in rows for side in ("chosen", "rejected")),
        lengths=[len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows])


def attach_reference(cfg: TrainConfig, tokenizer: Any, cache: Path) -> Path:
    """`<prepared cache>/reference/<reference key>/{train,val}`: the prepared pairs with the reference log-probs
    (`ref_chosen_logps`, `ref_rejected_logps`), computed once per reference model (objectives/dpo_reference.py),
    staged beside, sealed with their content hashes and published like the prepared data itself; checked on use."""

    from datasets import load_from_disk

    from dsrecipes.objectives.dpo_reference import precompute  # lazy: else `commands.train` imports torch 3.80 s

    final = cache / "reference" / reference_key(cfg)
    if (final / "done").is_file():
        check(final)
        return final
    final.parent.mkdir(exist_ok=True)
    tmp = staging_dir(final, "ref")
    try:
        splits = {split: load_from_disk(str(cache / split)) for split in ("train", "val") if (cache / split).is_dir()}
        logps = precompute(cfg, tokenizer, {split: (iter(ds), len(ds)) for split, ds in splits.items()})  # one load
        for split, ds in splits.items():
            chosen, rejected = logps[split]
            ds = ds.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)
            ds.save_to_disk(str(tmp / split))
        (tmp / "done").write_text(final.name, encoding="utf-8")
        seal(tmp)
        publish_dir(tmp, final, Existing.keep)  # another run computed the same reference first: theirs is kept
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def reference_key(cfg: TrainConfig) -> str:
    """The reference model's identity: the content hash of every file of `model.path` (data/prepare/cache.py, memoised by
    path, size, inode, modification and change time: weights swapped in with their modification time set back are
    hashed again), or the tiny model's config; its dtype and the attention implementation."""
    material: Dict[str, Any] = {"dtype": cfg.precision.dtype.value, "attn": cfg.model.attn_implementation.value}
    if cfg.model.path is None:
        material["tiny"] = config_to_dict(cfg.model.tiny)
    else:
        root = os.path.realpath(os.path.expanduser(cfg.model.path))
        files = sorted(os.path.relpath(os.path.join(d, f), root) for d, dirs, names in os.walk(root)
                       for f in names if not _hidden(os.path.relpath(os.path.join(d, f), root)))
        hashes = content_hashes(cfg, [os.path.join(root, f) for f in files])
        material.update(files=[list(pair) for pair in zip(files, hashes)])
    return hashlib.blake2b(json.dumps(material, sort_keys=True).encode(), digest_size=12).hexdigest()


def _hidden(rel: str) -> bool:
    """A file a download tool keeps beside the model (`.cache/huggingface/...`, `.gitattributes`): not the model."""
    return any(part.startswith(".") for part in Path(rel).parts)
