"""What `dataset.val_size` leaves to train on, said by `dsrecipes validate` before any row is prepared.

The hold-out is drawn from the kept rows (data/sources/splits.split_val), so validate knows its share only where it
knows how many rows there are at most: `dataset.max_samples`, each source's `max_samples`, or the rows of small local
files (counted here: non-blank JSON lines, or a JSON array's items; files over COUNT_BYTES, gzip, Parquet and URLs are
not read). A count of that many rows or more leaves nothing to train on: a problem (the run would refuse it after
reading every row). Half of the rows or more held out: a warning with the numbers of each split. The preparation's
own note (data/prepare/stats.py) gives the exact numbers once the rows are read.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

from dsrecipes.core.errors import UserError
from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.sources.files import expand_paths
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.remote import looks_like_url

COUNT_BYTES = 16 * 1024 * 1024  # the files of one source counted at most: a small dataset of one's own, in ~10 ms


def held_out(cfg: TrainConfig) -> Tuple[List[str], List[str]]:
    """(problems, warnings) about the share of the rows `dataset.val_size` holds out."""
    ds = cfg.dataset
    if ds.val_size <= 0 or ds.val_paths or ds.split.shares:  # val_paths: val_size unused; shares: drawn per share
        return [], []
    bound = row_bound(cfg)
    if bound is None:
        if ds.val_size >= 0.5 and ds.val_size < 1:
            return [], [f"dataset.val_size: {ds.val_size:g} holds out {ds.val_size:.0%} of the rows for validation "
                        f"and trains on {1 - ds.val_size:.0%}; {_fewer()}"]
        return [], []
    rows, where = bound
    if ds.val_size < 1:
        held = max(1, round(rows * ds.val_size))
        if held * 2 < rows:
            return [], []
        return [], [f"dataset.val_size: {ds.val_size:g} holds out {held} of at most {rows} rows ({where}) for "
                    f"validation and trains on at most {rows - held}; {_fewer()}"]
    held = int(ds.val_size)
    if held >= rows:
        return [f"dataset.val_size: {held} validation samples leave nothing to train on (at most {rows} rows, "
                f"{where}); set dataset.val_size to a fraction (0.1), a count below {rows}, or 0 for no validation"], []
    if held * 2 < rows:
        return [], []
    return [], [f"dataset.val_size: {held} held out of at most {rows} rows ({where}) leaves at most {rows - held} to "
                f"train on ({held / rows:.0%} or more for validation); {_fewer()}"]


def _fewer() -> str:
    return "dataset.val_size=0.05 (a fraction), a smaller count, or 0 trains on more of them"


def row_bound(cfg: TrainConfig) -> Optional[Tuple[int, str]]:
    """(the most rows a run of `cfg` can keep, where that number comes from), None where it is not known without
    reading large or remote files."""
    ds = cfg.dataset
    try:
        sources = resolve_sources(ds, [])
    except UserError:  # said by validate's own checks
        return None
    total: Optional[int] = 0
    capped = False
    for src in sources:
        rows = _counted(src.paths)
        if src.max_samples is not None and (rows is None or src.max_samples < rows):
            rows, capped = src.max_samples, True
        total = None if rows is None or total is None else total + rows
    if ds.max_samples is not None and (total is None or ds.max_samples <= total):
        return ds.max_samples, "dataset.max_samples"
    if total is None:
        return None
    return total, "counted in the dataset files" + (", under the sources' max_samples" if capped else "")


def _counted(patterns: List[str]) -> Optional[int]:
    if any(looks_like_url(p) for p in patterns):
        return None
    try:
        files = expand_paths(patterns)[0]
    except UserError:
        return None
    if not files or sum(os.path.getsize(f) for f in files) > COUNT_BYTES:
        return None
    rows = [_rows(f) for f in files]
    return None if None in rows else sum(rows)


def _rows(path: str) -> Optional[int]:
    try:
        with open(path, "rb") as f:
            data = f.read(COUNT_BYTES + 1)
        text = data.decode("utf-8-sig")
    except (OSError, UnicodeDecodeError):  # gzip, Parquet, unreadable: the run says what it is
        return None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            return None
        return len(items) if isinstance(items, list) else None
    return sum(1 for line in text.splitlines() if line.strip())
