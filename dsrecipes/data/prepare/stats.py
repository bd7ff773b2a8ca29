"""`prepare_stats.json`: what a preparation read, kept, dropped and produced, and its one-paragraph summary."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.data.render.batch_encode import Encoded
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.sources.badrows import BadRowReport, by_file_summary


def build_stats(cfg: TrainConfig, sources: Sequence[SourceConfig], report: BadRowReport, enc: Encoded,
                train_items: List[Tuple[int, int]], val_items: List[Tuple[int, int]]) -> Dict[str, Any]:
    kept_lengths = enc.lengths[enc.kept]
    trained = int((enc.labels != IGNORE_INDEX).sum())
    tokens = int(enc.lengths.sum())
    per_source: Dict[str, Dict[str, Any]] = {}
    weights = {src.name: src.weight for src in sources}
    for name, n in Counter(enc.sources).items():  # (in first-seen order)
        per_source[name] = {"conversations": n, "weight": weights.get(name, 1.0), "train_samples": 0}
    for i, _ in train_items:
        per_source[enc.sources[i]]["train_samples"] += 1
    id_counts = Counter(enc.ids)
    return {
        "row_kind": cfg.objective.rows.value,
        "dataset": cfg.dataset.name,
        "template": cfg.template.name.value,
        "train_on": cfg.data.train_on.value,
        "cutoff_len": cfg.data.cutoff_len,
        "packing": cfg.data.packing,
        "rows_read": report.rows_read,
        "rows_kept": len(enc.kept),
        "skipped": dict(sorted(report.counts.items())),
        "skipped_total": report.skipped,
        "skipped_by_file": report.files(),  # {file: {reason: rows}}
        "trailing_turns_dropped": report.trailing_turns_dropped,
        "truncated": int(enc.truncated.sum()),
        "truncated_share": float(enc.truncated.sum() / max(1, len(enc.kept))),
        "dropped_all_trained_cut": len(enc.dropped),
        "history_cut": enc.history_cut,  # train_on=last_assistant: kept the last reply, lost earlier turns
        "tokenization": {"one_text": enc.one_text, "per_segment_conversations": enc.per_segment},
        "duplicate_ids": sum(n - 1 for n in id_counts.values() if n > 1),
        "samples": {"train": len(train_items), "val": len(val_items)},
        "rows": {"train": 0, "val": 0},
        "tokens": tokens,
        "trained_tokens": trained,
        "trained_token_share": trained / tokens if tokens else 0.0,
        "length": _length_stats(kept_lengths, cfg.data.cutoff_len),
        "packing_efficiency": {"train": None, "val": None},  # real tokens / row slots, when packing
        "sources": per_source,
        "max_samples": cfg.dataset.max_samples,  # every source together; those it left unread:
        "unread_sources": [s.name for s in sources if s.name not in per_source] if cfg.dataset.max_samples else [],
        "short_sources": _short_sources(cfg, sources, per_source),
    }


def _short_sources(cfg: TrainConfig, sources: Sequence[SourceConfig], per_source: Dict[str, Dict[str, Any]]
                   ) -> Dict[str, List[int]]:
    """{source: [its max_samples, rows it gave]} for sources whose files hold fewer rows than their own cap (a
    dataset_info.json entry's num_samples, which LLaMA-Factory fills by drawing rows again), unless
    dataset.max_samples stopped the reading first."""
    taken = sum(v["conversations"] for v in per_source.values())
    if cfg.dataset.max_samples is not None and taken >= cfg.dataset.max_samples:
        return {}
    return {s.name: [s.max_samples, per_source[s.name]["conversations"]] for s in sources
            if s.max_samples is not None and s.share is None and s.name in per_source
            and per_source[s.name]["conversations"] < s.max_samples}


def _length_stats(lengths: np.ndarray, cutoff: int, bins: int = 8) -> Dict[str, Any]:
    if not len(lengths):
        return {"mean": 0, "max": 0, "histogram": []}
    edges = np.linspace(0, cutoff, bins + 1).astype(int)
    counts, _ = np.histogram(lengths, bins=edges)
    return {
        "mean": float(lengths.mean()),
        "p50": int(np.percentile(lengths, 50)),
        "p95": int(np.percentile(lengths, 95)),
        "max": int(lengths.max()),
        "histogram": [[int(a) + (i > 0), int(b), int(n)] for i, (a, b, n) in enumerate(zip(edges[:-1], edges[1:], counts))],
    }


def summary(stats: Dict[str, Any]) -> str:
    skipped = ", ".join(f"{k}={v}" for k, v in stats["skipped"].items()) or "none"
    if stats.get("skipped_by_file"):
        skipped += f" ({by_file_summary(stats['skipped_by_file'])})"
    lines = [
        f"data: {stats['rows_read']} rows read, {stats['rows_kept']} kept, skipped: {skipped}"
        + (f" (quarantine: {stats['quarantine']})" if stats.get("quarantine") else ""),
        f"data: {stats['samples']['train']} train / {stats['samples']['val']} val samples in "
        f"{stats['rows']['train']} / {stats['rows']['val']} rows; {stats['truncated']} truncated, "
        f"{stats['dropped_all_trained_cut']} dropped (nothing trained left), "
        + _history_cut_words(stats) +
        f"{stats['trailing_turns_dropped']} lost trailing non-assistant turns; trained tokens "
        f"{stats['trained_token_share']:.1%}",
    ]
    lines += _cut_note(stats) + _val_share_note(stats) + _unread_note(stats) + _short_note(stats)
    if stats.get("sources"):  # what was read, per source: a named dataset replaces the sample unless mixed
        lines.append("data: per source: " + ", ".join(
            f"{name} {v['conversations']} rows ({v.get('train_samples', '?')} train)" for name, v in stats["sources"].items()))
    eff = stats["packing_efficiency"]["train"]
    if eff is not None:
        lines.append(f"data: packing efficiency {eff:.1%} (train)")
    lines.append(f"data: cache {'hit' if stats.get('cache_hit') else 'written'}: {stats.get('cache_dir')}")
    return "\n".join(lines)


def _history_cut_words(stats: Dict[str, Any]) -> str:
    """The summary's words for rows that kept their last reply by losing earlier turns (train_on=last_assistant)."""
    cut = stats.get("history_cut", 0)  # (a preparation cached before the count was kept has none)
    return f"{cut} kept their last reply by dropping earlier turns (data.train_on=last_assistant), " if cut else ""


def _cut_note(stats: Dict[str, Any]) -> List[str]:
    """A note when rows were dropped because the cutoff left nothing to train on (a long system prompt or tool schemas
    before the answers): the first line says only 'N kept, skipped: none'."""
    dropped, read = stats["dropped_all_trained_cut"], stats["rows_read"]
    if not dropped:
        return []
    why, keep = "a long prompt, system prompt or tool schemas before the answers", ""
    if stats.get("train_on") == "last_assistant":  # what is left after the history cut (data/render/history_cut.py)
        why = ("data.train_on=last_assistant trains the last reply alone, and a row whose last reply starts past the "
               "cutoff drops whole earlier turns to keep it; in these rows the system prompt, tool schemas and last "
               "prompt turn alone fill the cutoff (never dropped here; LLaMA-Factory's mask_history cuts inside them "
               "and keeps such rows)")
        keep = ", data.train_on=assistant trains their earlier replies"
    return [f"note: {dropped} of {read} rows ({dropped / max(read, 1):.0%}) dropped: data.cutoff_len="
            f"{stats['cutoff_len']} cut all their trained tokens ({why}); a larger data.cutoff_len keeps them{keep}"]


def _unread_note(stats: Dict[str, Any]) -> List[str]:
    """A note when `dataset.max_samples` (a cap on all sources together, in order) left named sources unread: the
    per-source line lists only what was read, and LLaMA-Factory's max_samples caps each dataset."""
    unread = stats.get("unread_sources") or []
    if not unread:
        return []
    return [f"note: {', '.join(unread)}: no row read: dataset.max_samples={stats['max_samples']} caps all sources "
            "together, in order, and the sources before them filled it (LLaMA-Factory's max_samples caps each "
            "dataset; here a source's own max_samples does: a registry entry's num_samples)"]


def _short_note(stats: Dict[str, Any]) -> List[str]:
    """A note per source whose cap asks for more rows than its files hold: here it reads them once; LLaMA-Factory's
    num_samples draws rows again up to the number."""
    return [f"note: {name}: its max_samples (a dataset_info.json entry's num_samples) asks for {cap} rows and its files "
            f"gave {rows}: read once each here; LLaMA-Factory draws rows again up to {cap}, which a source weight of "
            f"{cap / max(rows, 1):.4g} does here (dataset.sources[i].weight, or weight in a YAML registry)"
            for name, (cap, rows) in (stats.get("short_sources") or {}).items()]


def _val_share_note(stats: Dict[str, Any]) -> List[str]:
    """A note when `dataset.val_size` holds out more than a quarter of the samples: the default 64 (the bundled
    sample's) takes most of a small file of one's own, and the run trains on the rest without a word otherwise."""
    train, val = stats["samples"]["train"], stats["samples"]["val"]
    if not val or val * 4 <= train + val or "dataset.val_paths" in stats.get("sources", {}):
        return []
    return [f"note: dataset.val_size holds out {val} of {train + val} samples ({val / (train + val):.0%}) for "
            "validation; dataset.val_size=0.05 (a fraction), a smaller count, or 0 trains on more of them"]
