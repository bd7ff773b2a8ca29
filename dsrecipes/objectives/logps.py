"""Answer log-probabilities of a batch of sequences (the DPO family's one model call), and the reference model's
config (the run's model without LoRA and activation checkpointing), shared by the live and precomputed references."""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import torch

from dsrecipes.core.schema import TrainConfig
from dsrecipes.objectives.base import IGNORE_INDEX, Batch
from dsrecipes.objectives.chunked_ce import hidden_and_head, token_nll


def sequence_logps(model: Any, batch: Batch, device: torch.device,
                   chunk_tokens: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p over each sequence's answer tokens, answer tokens) for the 2B sequences of a batch.
    `chunk_tokens` > 0: without the full-vocabulary logits, that many answer tokens at a time (chunked_ce)."""
    inputs = {"input_ids": batch["input_ids"].to(device), "attention_mask": batch["attention_mask"].to(device),
              "position_ids": batch["position_ids"].to(device)}
    if chunk_tokens > 0:
        hidden, head = hidden_and_head(model, **inputs)
        shift = torch.nn.functional.pad(batch["labels"].to(device)[:, 1:], (0, 1), value=IGNORE_INDEX)
        nll, _ = token_nll(hidden, head, shift, chunk_tokens)
        return -nll.sum(dim=1), (shift != IGNORE_INDEX).sum(dim=1)
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"].to(device)[:, 1:]
    mask = labels != IGNORE_INDEX
    logits = logits[:, :-1].float()
    picked = torch.gather(logits, 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = (picked - torch.logsumexp(logits, dim=-1)) * mask
    return per_token.sum(dim=1), mask.sum(dim=1)


def reference_config(cfg: TrainConfig) -> TrainConfig:
    """The reference model's config: the run's model without LoRA and without activation checkpointing."""
    model = dataclasses.replace(cfg.model, lora=dataclasses.replace(cfg.model.lora, enabled=False),
                                gradient_checkpointing=False)
    return dataclasses.replace(cfg, model=model)
