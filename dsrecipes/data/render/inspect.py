"""`dsrecipes inspect-data [overrides] --rows K`: prepared rows with trained tokens highlighted, plus statistics.

Runs the real preparation (`prepare`, so the cache is shared with training) and decodes the first K rows of a split.
Trained tokens are shown in green on a terminal, or between `[[` and `]]` otherwise (`--color` forces either);
packed rows show each sample under its own header.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

from dsrecipes.data.render.labels import IGNORE_INDEX

GREEN, RESET = "\033[42;30m", "\033[0m"
# Control characters from the data (ESC, BEL, CR, C1 ...) shown escaped, never sent to the terminal; \n and \t kept.
_VISIBLE = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\n\t"}


def render_row(row: Mapping[str, Any], tokenizer: Any, color: bool, title: str = "row") -> str:
    """Decode one prepared row: trained spans highlighted, one header per packed sample (a preference pair: the
    prompt once, then each side with its trained span)."""
    if "chosen_ids" in row:
        return render_pair(row, tokenizer, color, title)
    if "reference" in row:  # a prompt row (rows=prompt): nothing trained, the completions are sampled in training
        prompt = list(row["prompt_ids"])
        ref = str(row["reference"]).translate(_VISIBLE) or "(none)"
        return "\n".join([f"=== {title}: prompt {str(row['ids'][0]).translate(_VISIBLE)}, {len(prompt)} tokens, "
                          f"reference {ref}", _spans(prompt, [IGNORE_INDEX] * len(prompt), tokenizer, color)])
    ids, labels, positions = list(row["input_ids"]), list(row["labels"]), list(row["position_ids"])
    starts = [i for i, p in enumerate(positions) if p == 0] or [0]
    bounds = list(zip(starts, starts[1:] + [len(ids)]))
    out = [f"=== {title}: {len(ids)} tokens, {len(row['ids'])} sample(s)"]
    for k, (lo, hi) in enumerate(bounds):
        sample = str(row["ids"][k]).translate(_VISIBLE) if k < len(row["ids"]) else "?"
        trained = sum(1 for x in labels[lo:hi] if x != IGNORE_INDEX)
        out.append(f"--- sample {sample}: {hi - lo} tokens, {trained} trained")
        out.append(_spans(ids[lo:hi], labels[lo:hi], tokenizer, color))
    return "\n".join(out)


def render_pair(row: Mapping[str, Any], tokenizer: Any, color: bool, title: str = "row") -> str:
    prompt = list(row["prompt_ids"])
    out = [f"=== {title}: pair {str(row['ids'][0]).translate(_VISIBLE)}, prompt {len(prompt)} tokens"]
    out.append(_spans(prompt, [IGNORE_INDEX] * len(prompt), tokenizer, color))
    for side in ("chosen", "rejected"):
        ids, labels = list(row[f"{side}_ids"]), list(row[f"{side}_labels"])
        trained = sum(1 for x in labels if x != IGNORE_INDEX)
        ref = f", reference log-prob {row[f'ref_{side}_logps']:.3f}" if f"ref_{side}_logps" in row else ""
        out.append(f"--- {side}: {len(ids)} tokens, {trained} trained{ref}")
        out.append(_spans(ids, labels, tokenizer, color))
    return "\n".join(out)


def _spans(ids: Sequence[int], labels: Sequence[int], tokenizer: Any, color: bool) -> str:
    text = []
    i = 0
    while i < len(ids):
        trained = labels[i] != IGNORE_INDEX
        j = i
        while j < len(ids) and (labels[j] != IGNORE_INDEX) == trained:
            j += 1
        piece = tokenizer.decode(list(ids[i:j]), skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False).translate(_VISIBLE)
        if trained:
            piece = f"{GREEN}{piece}{RESET}" if color else f"[[{piece}]]"
        text.append(piece)
        i = j
    return "".join(text)


def format_stats(stats: Dict[str, Any]) -> str:
    skipped = stats["skipped"]
    lines = [
        "=== statistics",
        f"rows read {stats['rows_read']}, kept {stats['rows_kept']}, skipped {stats['skipped_total']}"
        + (" (" + ", ".join(f"{k}: {v}" for k, v in skipped.items()) + ")" if skipped else ""),
        f"samples: train {stats['samples']['train']}, val {stats['samples']['val']}; "
        f"rows: train {stats['rows']['train']}, val {stats['rows']['val']}",
        f"truncated {stats['truncated']} ({stats['truncated_share']:.1%} of kept), dropped with nothing trained "
        f"left {stats['dropped_all_trained_cut']}, last reply kept by dropping earlier turns "
        f"{stats.get('history_cut', 0)}, conversations with trailing non-assistant turns dropped "
        f"{stats['trailing_turns_dropped']}",
        f"tokens {stats['tokens']}, trained {stats['trained_tokens']} ({stats['trained_token_share']:.1%})",
    ]
    eff = stats["packing_efficiency"]
    if stats["packing"]:
        lines.append(f"packing efficiency: train {_pct(eff['train'])}, val {_pct(eff['val'])}")
    else:
        lines.append("packing: off")
    length = stats["length"]
    lines.append(f"sample length (tokens): mean {length['mean']:.1f}, p50 {length.get('p50', 0)}, "
                 f"p95 {length.get('p95', 0)}, max {length['max']} (cutoff_len {stats['cutoff_len']})")
    peak = max([n for _, _, n in length["histogram"]] + [1])
    for lo, hi, n in length["histogram"]:
        lines.append(f"  {lo:>6}-{hi:<6} {n:>8}  {'#' * round(40 * n / peak)}")
    return "\n".join(lines)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value:.1%}"
