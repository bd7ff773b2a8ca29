"""One prepared split -> an HF `datasets` directory (Arrow), packed or one row per sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.config.schema import TrainConfig
from dsrecipes.data.batch_encode import Encoded
from dsrecipes.data.labels import IGNORE_INDEX
from dsrecipes.data.sharegpt import Conversation
from dsrecipes.data.tokenize import pack_plan, packing_efficiency


def write_split(path: Path, items: List[Tuple[int, int]], convs: Sequence[Conversation], enc: Encoded,
                cfg: TrainConfig) -> Tuple[int, Optional[float]]:
    """Save one split as an HF dataset; returns (rows, packing efficiency or None)."""
    import datasets
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    conv_idx = np.array([i for i, _ in items], dtype=np.int64)
    sample_ids = [convs[i].id if copy == 0 else f"{convs[i].id}@{copy}" for i, copy in items]
    lengths = enc.lengths[conv_idx]
    cutoff = cfg.data.cutoff_len
    if cfg.data.packing:
        rows = pack_plan(lengths.tolist(), cutoff)
        order = np.array([m for row in rows for m in row], dtype=np.int64)
        row_sizes = np.array([len(row) for row in rows], dtype=np.int64)  # samples per row
    else:
        order = np.arange(len(items), dtype=np.int64)
        row_sizes = np.ones(len(items), dtype=np.int64)
    lens = lengths[order]
    first = np.cumsum(lens) - lens  # where each sample starts in the output
    gather = np.repeat(enc.starts[conv_idx[order]] - first, lens) + np.arange(int(lens.sum()))
    input_ids, labels = enc.input_ids[gather], enc.labels[gather].copy()
    positions = (np.arange(int(lens.sum())) - np.repeat(first, lens)).astype(np.int32)
    if cfg.data.packing:
        labels[first[lens > 0]] = IGNORE_INDEX  # never predict across a sample boundary
    sample_bounds = np.concatenate([[0], np.cumsum(row_sizes)])
    token_bounds = np.concatenate([[0], np.cumsum(lens)])[sample_bounds]

    def lists(values: Any, bounds: np.ndarray) -> pa.Array:
        if bounds[-1] >= 2**31:  # more than 2^31 tokens in one split: 64-bit offsets
            return pa.LargeListArray.from_arrays(pa.array(bounds, pa.int64()), values)
        return pa.ListArray.from_arrays(pa.array(bounds, pa.int32()), values)

    ordered_ids = [sample_ids[i] for i in order]
    table = pa.table({
        "ids": lists(pa.array(ordered_ids, pa.string()), sample_bounds),
        "input_ids": lists(pa.array(input_ids, pa.int32()), token_bounds),
        "labels": lists(pa.array(labels, pa.int32()), token_bounds),
        "position_ids": lists(pa.array(positions, pa.int32()), token_bounds),
    })
    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one summary line at the end instead of a bar per split
    try:
        Dataset(InMemoryTable(table)).save_to_disk(str(path))
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    eff = packing_efficiency(int(lens.sum()), len(row_sizes), cutoff) if cfg.data.packing else None
    return len(row_sizes), eff

