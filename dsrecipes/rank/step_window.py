"""The training steps between two log lines, on every rank: loss, tokens, samples and the objective's sums added up as
tensors (no device sync per micro-batch) and reduced over the ranks once per log step (observe/metrics.py prints and
records what this returns)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Tuple

import torch

from dsrecipes.core.distributed import all_reduce


@dataclass
class Window:
    """Per-rank sums since the last log line; `reduce()` turns them into global numbers (a collective call)."""

    loss_sum: Any = 0.0  # sum of micro-batch mean losses (a tensor: no device sync per micro-batch)
    micro_batches: int = 0
    tokens: int = 0  # real (non-pad) input tokens
    samples: int = 0
    started: float = 0.0
    excluded: float = 0.0  # seconds spent inside `paused()` (eval, checkpoints)
    keys: Tuple[str, ...] = ()  # the objective's train sums (objectives/base.py `train_keys`), in `batch["sums"]`
    extra: Any = None  # their running sums (a tensor: no device sync per micro-batch)

    def add(self, loss: torch.Tensor, batch: Dict[str, Any]) -> None:
        self.loss_sum = self.loss_sum + loss.detach().float()
        self.micro_batches += 1
        self.tokens += int(batch["num_tokens"])
        self.samples += len(batch["ids"])
        if self.keys:
            got = torch.stack([batch["sums"][k].detach().double().cpu() for k in self.keys])
            self.extra = got if self.extra is None else self.extra + got

    def reduce(self) -> Dict[str, float]:
        """{loss: mean micro-batch loss over all ranks, tokens, samples: summed over ranks, seconds, sums: the
        objective's train sums over all ranks}."""
        extra = self.extra if self.extra is not None else torch.zeros(len(self.keys), dtype=torch.float64)
        sums = torch.cat([torch.tensor([float(self.loss_sum), self.micro_batches, self.tokens, self.samples],
                                       dtype=torch.float64), extra])
        all_reduce(sums)
        loss_sum, micro_batches, tokens, samples = sums[:4].tolist()
        seconds = max(time.perf_counter() - self.started - self.excluded, 1e-9)
        return {"loss": loss_sum / max(micro_batches, 1), "tokens": tokens, "samples": samples, "seconds": seconds,
                "micro_batches": micro_batches, "sums": dict(zip(self.keys, sums[4:].tolist()))}

    def reset(self) -> None:
        self.loss_sum, self.micro_batches, self.tokens, self.samples = 0.0, 0, 0, 0
        self.started, self.excluded, self.extra = time.perf_counter(), 0.0, None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in this block does not count towards tokens/s."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - start
