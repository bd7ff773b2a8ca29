"""Reference log-probabilities for DPO: computed once before training (`objective.reference=precomputed`), or live.

Precomputed (the default): the launching process loads the reference model once (the run's `model.path`, or the
seeded tiny model; with LoRA the base alone, which is what the adapted model starts as), computes the summed answer
log-probs of every prepared pair in `trainer.micro_batch_size` batches (on a GPU if it has one, else the CPU) and the
caller stores them with the prepared data under `data/prepare/pairs.py::reference_key`: the content hash of the
model's files (the tiny model's config), its dtype and the attention implementation. Training then holds one model.
Live references: objectives/dpo_live.py.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple

import torch

from dsrecipes.core.schema import TrainConfig
from dsrecipes.modeling.model import build_model
from dsrecipes.objectives.base import Row, pad_token_id
from dsrecipes.objectives.dpo import collate_pairs
from dsrecipes.objectives.logps import reference_config, sequence_logps


@torch.no_grad()
def precompute(cfg: TrainConfig, tokenizer: Any, rows: Iterable[Row], n_rows: int) -> Tuple[List[float], List[float]]:
    """(chosen, rejected) reference log-probs of every row, in row order."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(reference_config(cfg), tokenizer).to(device).eval()
    pad, size = pad_token_id(tokenizer), cfg.trainer.micro_batch_size
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
            batch = []
    del model
    return chosen, rejected

