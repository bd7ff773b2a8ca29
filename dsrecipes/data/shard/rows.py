"""The rows `dsrecipes shard` writes into parts: every row checked as training checks it, in one canonical form.

One row kind per set of parts, the run's `objective.rows`, recorded in the manifest's `row_format` (data/rowkinds.py:
each kind's format name, what its parts hold, how its rows are checked and written). Every kind is written in the
layout of `samples.canonical_row`: `id`, `conversations: [{from: <role>, value}]`, `system`, `tools`, plus the kind's
own columns (a pair's `chosen` and `rejected` as one assistant message each, a prompt's `reference`).
Roles are `sharegpt.Role` values, so a part needs no column settings, and sample ids survive (`<source file>:<line>`
when the row had none). A presharded run refuses parts of another kind (`check_row_format`).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Optional, Tuple

from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import RowKind
from dsrecipes.data.rowkinds import ROW_KINDS, resolved
from dsrecipes.data.sources.badrows import BadReason, BadRow

ROW_FORMAT = ROW_KINDS[RowKind.conversation].row_format  # canonical rows: roles are sharegpt.Role values
PAIR_ROW_FORMAT = ROW_KINDS[RowKind.pair].row_format  # canonical preference pairs (objective.rows=pair)
PROMPT_ROW_FORMAT = ROW_KINDS[RowKind.prompt].row_format  # canonical prompts (objective.rows=prompt)
HELD = {spec.row_format: spec.what for spec in ROW_KINDS.values()}  # row_format -> what such parts hold


def checked_rows(cfg: Any, report: Any, encoder: Any, sources: List[Any],
                 no_reference: Optional[List[int]] = None) -> Iterator[Tuple[bytes, int]]:
    """(canonical line, tokens in a run) of every row that passes training's checks; the policy is enforced at the
    end. A row whose canonical form outgrows `dataset.max_row_bytes` is a bad row here (the parts never hold one).
    `no_reference` gets the positions (among the lines yielded) of prompt rows without a reference answer."""
    yielded = 0
    for where, row, tokens in _canonical_rows(cfg, report, encoder, sources):
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        if len(line) - 1 > cfg.dataset.max_row_bytes:
            report.add(where.path, where.loc, BadRow(BadReason.too_large, "its canonical form is longer than "
                                                     f"dataset.max_row_bytes={cfg.dataset.max_row_bytes}"),
                       None, where.element)
            continue
        if no_reference is not None and cfg.objective.rows is RowKind.prompt and row.get("reference") is None:
            no_reference.append(yielded)
        yielded += 1
        yield line, tokens
    report.check()


def _canonical_rows(cfg: Any, report: Any, encoder: Any, sources: List[Any]) -> Iterator[Tuple[Any, Dict, int]]:
    """(the row's Conversation: where it was read, canonical row, tokens in a run) of every checked row of the run's
    row kind (a pair's tokens: the prompt and both answers)."""
    spec = ROW_KINDS[cfg.objective.rows]
    canonical = resolved(spec.canonical)
    for item, encoded in resolved(spec.checked)(cfg, report, encoder, sources):
        yield spec.where(item), canonical(item), spec.token_count(encoded)


def row_format(cfg: Any) -> str:
    """The canonical rows a run of `cfg` reads from parts: those of its objective's row kind (`objective.rows`)."""
    return ROW_KINDS[cfg.objective.rows].row_format


def check_row_format(manifest: Any, cfg: Any) -> None:
    """Parts hold the rows of the objective they were sharded for; refuse training another objective on them."""
    want = row_format(cfg)
    if manifest.row_format == want:
        return
    held = HELD.get(manifest.row_format, "rows of another kind")
    raise DataError(f"data.shard_dir: {manifest.directory} holds {held} (row_format {manifest.row_format}), but "
                    f"this run's objective trains on {HELD[want]} (objective.rows={cfg.objective.rows.value}); shard "
                    "the data for this objective: `dsrecipes shard INPUT... --parts N --out NEW_DIR objective=<the "
                    "run's objective>`")
