"""What `dataset.val_size` leaves to train on, said by `dsrecipes validate` before any row is prepared.

The hold-out is drawn from the kept rows (data/sources/splits.split_val), so validate knows its share only where it
knows how many rows there are at most: `dataset.max_samples`, each source's `max_samples`, or the rows of small local
files (counted as the run reads them; files over COUNT_BYTES, gzip, Parquet and URLs are not read). A count of that
many rows or more leaves nothing to train on: a problem (the run would refuse it after reading every row). Half of
the rows or more held out: a warning with the numbers of each split. The preparation's own note
(data/prepare/stats.py) gives the exact numbers once the rows are read.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

from dsrecipes.core.errors import UserError
from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.sources.files import RawRow, expand_paths, read_row_items
from dsrecipes.data.sources.formats import other_format
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.remote import looks_like_url

# the files of one source counted at most: a small dataset of one's own (16 MiB: ~0.1 s as JSON lines, ~2 s as one
# JSON array, which the run's scanner reads element by element)
COUNT_BYTES = 16 * 1024 * 1024
FEWER = "dataset.val_size=0.05 (a fraction), a smaller count, or 0 trains on more of them"


def held_out(cfg: TrainConfig) -> Tuple[List[str], List[str]]:
    """(problems, warnings) about the share of the rows `dataset.val_size` holds out."""
    ds = cfg.dataset
    if ds.val_size <= 0 or ds.val_paths or ds.split.shares:  # val_paths: val_size unused; shares: drawn per share
        return [], []
    fraction = ds.val_size < 1
    bound = row_bound(cfg)
    if bound is None:  # only a fraction says its share without the rows
        if fraction and ds.val_size >= 0.5:
            return [], [f"dataset.val_size: {ds.val_size:g} holds out {ds.val_size:.0%} of the rows for validation "
                        f"and trains on {1 - ds.val_size:.0%}; {FEWER}"]
        return [], []
    rows, where = bound
    held = max(1, round(rows * ds.val_size)) if fraction else int(ds.val_size)
    if not fraction and held >= rows:
        return [f"dataset.val_size: {held} validation samples leave nothing to train on (at most {rows} rows, "
                f"{where}); set dataset.val_size to a fraction (0.1), a count below {rows}, or 0 for no validation"], []
    if held * 2 < rows:
        return [], []
    known = f"of at most {rows} rows ({where})"
    said = (f"{ds.val_size:g} holds out {held} {known} for validation and trains on at most {rows - held}" if fraction
            else f"{held} held out {known} leaves at most {rows - held} to train on ({held / rows:.0%} or more for "
            "validation)")
    return [], [f"dataset.val_size: {said}; {FEWER}"]


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
    """The rows of local files as the run reads them (files.read_row_items: non-blank lines, a .json file's values),
    None where they are not read here: URLs, more than COUNT_BYTES, gzip and Parquet (their bytes say little of
    what reading them costs), a file that does not read to its end (the run says what it is)."""
    if any(looks_like_url(p) for p in patterns):
        return None
    try:
        files = expand_paths(patterns)[0]
    except UserError:
        return None
    if not files or sum(os.path.getsize(f) for f in files) > COUNT_BYTES:
        return None
    if any(f.endswith(".gz") or other_format(f) == "parquet" for f in files):
        return None
    try:
        return sum(1 for f in files for item in read_row_items(f) if not isinstance(item, RawRow))
    except (UserError, OSError):  # FileUnreadable: a broken JSON array, a read error
        return None
