"""A long evaluation moves: the stall watchdog (core/stall.py) must not end a run whose evaluation (validation loss,
prompt-eval) takes longer than launcher.stall_timeout_s while it scores micro-batch after micro-batch."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

import dsrecipes.core.stall as stall
from dsrecipes.rank.evaluation import evaluate


class _Objective:
    eval_keys = ("loss",)

    def eval_sums(self, engine: Any, batch: Dict[str, Any], device: Any) -> Dict[str, float]:
        return {"loss": 1.0}

    def collate(self, rows: List[Any]) -> Dict[str, Any]:
        return {"ids": []}

    def metrics(self, sums: Dict[str, float], prefix: str) -> Dict[str, float]:
        return {prefix + k: v for k, v in sums.items()}


class _Engine:
    device = torch.device("cpu")

    def eval(self) -> None: ...

    def train(self) -> None: ...


class _Loader:
    """Micro-batches that each take an hour of the watchdog's clock: where the main thread stands at each."""

    def __init__(self, n: int):
        self.n = n
        self.seen: List[str] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for i in range(self.n):
            self.seen.append(stall.current.encode())
            yield {"ids": [f"s{i}"]}


def test_an_evaluation_that_scores_batches_is_progress_not_a_stall():
    stall.reset()
    stall.mark("eval", 7)
    loader = _Loader(4)
    evaluate(_Objective(), _Engine(), loader, step=7)
    positions = loader.seen + [stall.current.encode()]
    assert len(set(positions)) == len(positions), positions  # every scored micro-batch is a move
    watch = stall.Watch(warn_s=60, timeout_s=1800)
    for hour, position in enumerate(positions):  # an hour a micro-batch, well past stall_timeout_s in all
        assert watch.observe({0: position}, hour * 3600.0) is None
    stall.reset()
