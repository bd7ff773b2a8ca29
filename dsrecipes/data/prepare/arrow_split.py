"""One prepared split -> an HF `datasets` directory (Arrow), packed or one row per sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Tuple

import numpy as np

from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.render.batch_encode import Encoded
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.packing import pack_plan, packing_efficiency


def write_split(path: Path, items: List[Tuple[int, int]], enc: Encoded, cfg: TrainConfig,
                fingerprint: str) -> Tuple[int, Optional[float]]:
    """Save one split as an HF dataset; returns (rows, packing efficiency or None). `fingerprint`: the dataset's
    `datasets` fingerprint (the preparation's cache key and the split name identify its content)."""
    import datasets
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    conv_idx = np.array([i for i, _ in items], dtype=np.int64)
    sample_ids = [enc.ids[i] if copy == 0 else f"{enc.ids[i]}@{copy}" for i, copy in items]
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
    input_ids, labels = _gather(enc, conv_idx[order])
    first = np.cumsum(lens) - lens  # where each sample starts in the output
    if cfg.data.packing:
        labels = labels.copy() if labels is enc.labels else labels
        labels[first[lens > 0]] = IGNORE_INDEX  # never predict across a sample boundary
    positions = _restarting_ranges(lens)
    sample_bounds = np.concatenate([[0], np.cumsum(row_sizes)])
    token_bounds = np.concatenate([[0], np.cumsum(lens)])[sample_bounds]

    def lists(values: Any, bounds: np.ndarray) -> pa.Array:
        if bounds[-1] >= 2**31:  # more than 2^31 tokens in one split: 64-bit offsets
            return pa.LargeListArray.from_arrays(pa.array(bounds, pa.int64()), values)
        return pa.ListArray.from_arrays(pa.array(bounds, pa.int32()), values)

    ordered_ids = sample_ids if not cfg.data.packing else [sample_ids[i] for i in order]
    table = pa.table({
        "ids": lists(pa.array(ordered_ids, pa.string()), sample_bounds),
        "input_ids": lists(pa.array(input_ids, pa.int32()), token_bounds),
        "labels": lists(pa.array(labels, pa.int32()), token_bounds),
        "position_ids": lists(pa.array(positions, pa.int32()), token_bounds),
    })
    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one summary line at the end instead of a bar per split
    try:
        # An explicit fingerprint: without one, datasets hashes the whole table (pickles it: ~half the write time).
        Dataset(InMemoryTable(table), fingerprint=fingerprint).save_to_disk(str(path))
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    eff = packing_efficiency(int(lens.sum()), len(row_sizes), cutoff) if cfg.data.packing else None
    return len(row_sizes), eff



def _gather(enc: Encoded, conv_idx: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The tokens and labels of these conversations, in this order (no copy when that is all of them, in order)."""
    if len(conv_idx) == len(enc.kept) and np.array_equal(conv_idx, enc.kept):
        return enc.input_ids, enc.labels
    starts, lens = enc.starts[conv_idx], enc.lengths[conv_idx]
    pieces = [(int(a), int(a + n)) for a, n in zip(starts, lens)]
    return (np.concatenate([enc.input_ids[a:b] for a, b in pieces] or [np.zeros(0, np.int32)]),
            np.concatenate([enc.labels[a:b] for a, b in pieces] or [np.zeros(0, np.int32)]))


def _restarting_ranges(lens: np.ndarray) -> np.ndarray:
    """0, 1, ..., n-1 for every length n, concatenated (int32, one pass of cumsum)."""
    total = int(lens.sum())
    steps = np.ones(total, dtype=np.int32)
    if total:
        nonzero = lens[lens > 0]
        starts = np.cumsum(nonzero) - nonzero
        steps[starts[1:]] = 1 - nonzero[:-1]  # back to 0 at each sample's first token
        steps[0] = 0
        np.cumsum(steps, out=steps)
    return steps
