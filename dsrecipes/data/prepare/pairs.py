"""Preparation of preference pairs (`rows=pair`, `data=map`): read and tokenize pairs, split, mix, write Arrow.

The same order of operations as SFT preparation (prepare.py): sources in order with their caps and the bad-row
policy, the seeded validation split, per-source mixing weights (a copy k >= 1 of a pair gets the id `<id>@<k>`),
then one Arrow dataset per split. No packing: a pair's two sequences are its own micro-batch rows. The stats keep
the keys of SFT preparation (`prepare_stats.summary`, `inspect-data`), counted in pairs; "trained tokens" are the
answers' tokens on both sides.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

from dsrecipes.core.errors import DataError
from dsrecipes.core.publish import Existing, publish_dir, staging_dir
from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.prepare.cache import content_hashes
from dsrecipes.data.prepare.cache_contents import check, seal
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.preference_encode import read_and_encode_pairs
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.splits import split_and_mix

COLUMNS = ("ids", "prompt_ids", "chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")


def build(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig], val: Sequence[SourceConfig],
          report: BadRowReport, out: Path) -> Dict[str, Any]:
    """Write `out/train` (and `out/val`); returns the preparation's stats. `val`: `dataset.val_paths` as one source
    (prepare.val_sources), read after the training sources and not capped by `dataset.max_samples`; its pairs are
    then the validation split, as for conversations (splits.split_and_mix)."""
    return build_rows(cfg, tokenizer, sources, val, report, out, read_and_encode_pairs, _stats, "preference pairs",
                      lambda rows: COLUMNS + (("margin",) if any(r.get("margin") is not None for r in rows) else ()))


def build_rows(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig], val: Sequence[SourceConfig],
               report: BadRowReport, out: Path, read: Callable, stats_of: Callable, what: str,
               columns_of: Callable[[List[Dict[str, Any]]], Sequence[str]]) -> Dict[str, Any]:
    """The preparation of rows that are one sample each (pairs, prompts): `read` the sources (then `val`, uncapped),
    split and mix, one Arrow dataset per split with the `columns_of(rows)`; `stats_of` counts them."""
    from datasets import Dataset

    rows, names = read(cfg, tokenizer, sources, report)
    trained = len(rows)
    if val:
        uncapped = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, max_samples=None))
        more, more_names = read(uncapped, tokenizer, val, report)
        rows, names = rows + more, names + more_names
    report.check()
    if not trained:
        raise DataError(f"dataset {cfg.dataset.name}: no usable {what} ({report.summary()})")
    train_items, val_items = split_and_mix(range(trained), range(trained, len(rows)), names,
                                           {src.name: src.weight for src in sources}, cfg.dataset.val_size,
                                           cfg.trainer.seed)
    stats = stats_of(cfg, report, rows, names, len(train_items), len(val_items))
    for name, n in Counter(names[i] for i, _ in train_items).items():  # the summary's per-source line
        stats["sources"][name]["train_samples"] = n
    columns = columns_of(rows)
    for split, items in (("train", train_items), ("val", val_items)):
        if not items:
            continue
        table = {c: [_copy(rows[i], c, k) for i, k in items] for c in columns}
        Dataset.from_dict(table).save_to_disk(str(out / split))
        stats["rows"][split] = len(items)
    return stats


def _copy(row: Dict[str, Any], column: str, copy: int) -> Any:
    if column == "ids" and copy:
        return [f"{row['ids'][0]}@{copy}"]
    return row.get(column)  # (a pair's margin: None where it has none)


def _stats(cfg: TrainConfig, report: BadRowReport, rows: List[Dict[str, Any]], names: List[str], n_train: int,
           n_val: int) -> Dict[str, Any]:
    tokens = sum(len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows)
    trained = sum(sum(lab != IGNORE_INDEX for lab in r[f"{side}_labels"]) for r in rows for side in ("chosen", "rejected"))
    truncated = sum(bool(r["truncated"]) for r in rows)
    longest = [len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows]
    return {
        "row_kind": cfg.objective.rows.value,
        "dataset": cfg.dataset.name,
        "template": cfg.template.name.value,
        "train_on": "last_assistant",
        "cutoff_len": cfg.data.cutoff_len,
        "packing": cfg.data.packing,
        "rows_read": report.rows_read,
        "rows_kept": len(rows),
        "skipped": dict(sorted(report.counts.items())),
        "skipped_total": report.skipped,
        "skipped_by_file": report.files(),
        "trailing_turns_dropped": 0,
        "truncated": truncated,
        "truncated_share": truncated / len(rows),
        "dropped_all_trained_cut": 0,
        "duplicate_ids": sum(n - 1 for n in Counter(r["ids"][0] for r in rows).values() if n > 1),
        "samples": {"train": n_train, "val": n_val},
        "rows": {"train": 0, "val": 0},
        "tokens": tokens,
        "trained_tokens": trained,
        "trained_token_share": trained / tokens if tokens else 0.0,
        "length": {"mean": sum(longest) / len(longest), "p50": sorted(longest)[len(longest) // 2],
                   "p95": sorted(longest)[int(len(longest) * 0.95)], "max": max(longest), "histogram": []},
        "packing_efficiency": {"train": None, "val": None},
        "sources": {name: {"conversations": n, "train_samples": 0} for name, n in Counter(names).items()},
    }


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
        for split in ("train", "val"):
            if not (cache / split).is_dir():
                continue
            ds = load_from_disk(str(cache / split))
            chosen, rejected = precompute(cfg, tokenizer, iter(ds), len(ds))
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
