"""Validation rows dealt to ranks: each strategy's `eval_loader` (data/strategies/) builds one from its rows."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, List, Optional, Sequence

from dsrecipes.data.strategies.base import Batch, Row


class EvalLoader:
    """The validation rows of one rank: a contiguous share (sizes differ by at most one row), in order.

    Ranks can end one micro-batch apart; the evaluation (dsrecipes/rank/evaluation.py) pads the shorter ranks with
    zero-weight forward passes (ZeRO-3 forwards are collective), so every row is scored once and none twice. Each
    batch carries the rows' positions (`keys`: `row<N>`, N the row's place in the validation rows; `first` is that of
    `rows[0]` when a rank's share was cut before its rows were made, as iterable and presharded do), which the
    evaluation ledger counts (data/plan/eval_ledger.py): unique across ranks, however the samples' ids repeat.
    """

    def __init__(self, rows: Sequence[Row], rank: int, world_size: int, micro_batch_size: int,
                 collate_fn: Callable[[List[Row]], Batch], first: int = 0):
        n = len(rows)
        self.start, self.stop = rank * n // world_size, (rank + 1) * n // world_size
        self.first = first
        self.rows = rows
        self.micro_batch_size = micro_batch_size
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return math.ceil((self.stop - self.start) / self.micro_batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for lo in range(self.start, self.stop, self.micro_batch_size):
            hi = min(lo + self.micro_batch_size, self.stop)
            getitems = getattr(self.rows, "__getitems__", None)
            rows = list(getitems(list(range(lo, hi)))) if getitems else [self.rows[i] for i in range(lo, hi)]
            batch = self.collate_fn(rows)
            batch["keys"] = [f"row{self.first + i}" for i in range(lo, hi)]  # positions (data/plan/eval_ledger.py)
            yield batch


def limit_rows(rows: Any, samples: Optional[int]) -> Any:
    """The first rows of a validation split that hold `samples` samples (None: all). A packed row counts its samples
    and is taken whole, so with packing the cut is the first rows holding at least `samples` samples."""
    if samples is None:
        return rows
    taken = count = 0
    ids = rows["ids"] if hasattr(rows, "column_names") else [row["ids"] for row in rows]
    for row_ids in ids:
        if count >= samples:
            break
        taken += 1
        count += len(row_ids)
    return rows.select(range(taken)) if hasattr(rows, "select") else rows[:taken]
