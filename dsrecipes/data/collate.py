"""Prepared rows -> one padded micro-batch.

Right padding: `input_ids` with the tokenizer's pad id, `labels` with -100. Rows that pack several samples get
`attention_mask=None` and `position_ids` that restart at 0 per sample: transformers then builds a per-sample causal
(block-diagonal) mask from the position ids, which it only does when no attention mask is given (`use_cache=False`).
Padding positions restart at 0 too, so padding forms a block of its own and never mixes with a real sample; with
right padding and causal attention no real token sees it anyway. Batches whose rows each hold one sample get an
ordinary 0/1 `attention_mask`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from dsrecipes.data.labels import IGNORE_INDEX


def is_packed(rows: Sequence[Mapping[str, Any]]) -> bool:
    """True when some row holds more than one sample."""
    return any(len(row["ids"]) > 1 for row in rows)


def collate(rows: Sequence[Mapping[str, Any]], pad_id: int, *, packing: Optional[bool] = None) -> Dict[str, Any]:
    """`rows`: prepared rows (`ids`, `input_ids`, `labels`, optional `position_ids`).

    Returns tensors `input_ids`, `labels`, `position_ids` (int64, [batch, longest row]), `attention_mask`
    (None when packing), plus `ids` (flat list of the sample ids in the batch), `num_tokens` (real tokens) and
    `num_label_tokens` (labels that count in the shifted causal-LM loss). `packing=None` decides from the rows.
    """
    import torch

    if not rows:
        raise ValueError("collate: empty batch")
    packed = is_packed(rows) if packing is None else packing
    width = max(len(row["input_ids"]) for row in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    attention_mask = None if packed else torch.zeros((n, width), dtype=torch.long)
    ids: List[str] = []
    num_tokens = 0
    for r, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[r, :length] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        labels[r, :length] = torch.as_tensor(row["labels"], dtype=torch.long)
        pos = row.get("position_ids")
        position_ids[r, :length] = torch.as_tensor(pos, dtype=torch.long) if pos is not None else torch.arange(length)
        position_ids[r, length:] = torch.arange(width - length)
        if attention_mask is not None:
            attention_mask[r, :length] = 1
        ids.extend(row["ids"])
        num_tokens += length
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "ids": ids,
        "num_tokens": num_tokens,
        "num_label_tokens": int((labels[:, 1:] != IGNORE_INDEX).sum()),
    }
