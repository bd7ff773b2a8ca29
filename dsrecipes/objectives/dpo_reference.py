"""Reference log-probabilities for DPO: computed once before training (`objective.reference=precomputed`), or live.

Precomputed (the default): the launching process loads the reference model once (the run's `model.path`, or the
seeded tiny model; with LoRA the base alone, which is what the adapted model starts as), computes the summed answer
log-probs of every prepared pair in `trainer.micro_batch_size` batches (on a GPU if it has one, else the CPU) and the
caller stores them with the prepared data under `data/prepare/pairs.py::reference_key`: the content hash of the
model's files (the tiny model's config), its dtype and the attention implementation. Training then holds one model.
Live references: objectives/dpo_live.py.

The pass runs before the first step (a minute or two for a 135M model on a CPU), so it says so on stderr: a line
before the model loads, a progress line at most every PROGRESS_EVERY_S seconds (pairs done, rate, time left), and
a closing line; a second run with the same reference reads the cache and prints none of them.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, Iterable, List, Mapping, Tuple

import torch

from dsrecipes.core.schema import TrainConfig
from dsrecipes.modeling.model import build_model
from dsrecipes.objectives.base import Row, pad_token_id
from dsrecipes.objectives.dpo import collate_pairs
from dsrecipes.objectives.logps import reference_config, sequence_logps
from dsrecipes.observe.metrics import format_seconds

PROGRESS_EVERY_S = 15.0  # at most one progress line per this many seconds


def _say(text: str) -> None:
    print(f"reference pass: {text}", file=sys.stderr, flush=True)


@torch.no_grad()
def precompute(cfg: TrainConfig, tokenizer: Any, splits: Mapping[str, Tuple[Iterable[Row], int]]
               ) -> Dict[str, Tuple[List[float], List[float]]]:
    """{split: (chosen, rejected)} reference log-probs of every row of each split (rows, their count), in row order,
    with ONE load of the reference model for all splits (progress on stderr: module docstring)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    started, total = time.monotonic(), sum(n for _, n in splits.values())
    _say(f"log-probs of {total:,} pairs under the reference model ({cfg.model.path or 'the tiny model'}) on "
         f"{device.type}, once before the first step; cached with the prepared data for later runs")
    model = build_model(reference_config(cfg), tokenizer).to(device).eval()
    progress = _Progress(total)
    out = {name: _split_logps(model, device, rows, n, cfg.trainer.micro_batch_size, pad_token_id(tokenizer), progress)
           for name, (rows, n) in splits.items()}
    del model
    _say(f"{total:,} pairs in {format_seconds(time.monotonic() - started)}")
    return out


class _Progress:
    """A progress line at most every PROGRESS_EVERY_S over all splits: pairs done, rate, time left."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0
        self.computing = self.said = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.said >= PROGRESS_EVERY_S and self.done < self.total:
            self.said = time.monotonic()
            rate = self.done / max(self.said - self.computing, 1e-9)
            _say(f"{self.done:,}/{self.total:,} pairs ({self.done / self.total:.0%}), {rate:.1f} pairs/s, "
                 f"about {format_seconds((self.total - self.done) / rate)} left")


def _split_logps(model: Any, device: torch.device, rows: Iterable[Row], n_rows: int, size: int, pad: int,
                 progress: _Progress) -> Tuple[List[float], List[float]]:
    chosen: List[float] = []
    rejected: List[float] = []
    batch: List[Row] = []
    for i, row in enumerate(rows):
        batch.append(row)
        if len(batch) == size or i == n_rows - 1:
            logps, _ = sequence_logps(model, collate_pairs(batch, pad), device)
            c, r = logps.float().cpu().chunk(2)
            chosen += c.tolist()
            rejected += r.tolist()
            progress.add(len(batch))
            batch = []
    return chosen, rejected
