"""`objective.loss_average=tokens` (SFT's default): every trained token of an optimizer step weighs the same, whatever
micro-batch and rank it lands in, as in transformers' Trainer (TRL, LLaMA-Factory) with gradient accumulation and
`average_tokens_across_devices`.

DeepSpeed divides each micro-batch's loss by `grad_accum` and averages gradients over the `world_size` ranks. A
micro-batch whose loss is its summed cross-entropy times `grad_accum * world_size / T`, where T counts the trained
tokens of the whole step (every micro-batch, every rank), therefore contributes exactly its share of the step's
token mean. T must be known before the step's first backward: `weigh_steps` reads the step's `grad_accum`
micro-batches from the loader first, adds up the tokens each one's loss counts (the objective's `tokens`: SFT's
collated `num_label_tokens`; GRPO samples and scores the completions there, all of the step's before its first
backward, as TRL's generation batch) and sums that over the ranks (one small all-reduce per step; none alone).

With `micro_batches`, each micro-batch's loss is its own token mean: a micro-batch of a few short answers weighs as
much as one of long answers (the DeepSpeed-Chat way; the logged loss is then the mean of micro-batch means).
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Dict, Iterable, Iterator

import torch

import dsrecipes.core.stall as stall
from dsrecipes.core.distributed import all_reduce


def weigh_steps(batches: Iterable[Dict[str, Any]], grad_accum: int, world_size: int,
                count: Callable[[Dict[str, Any]], int]) -> Iterator[Dict[str, Any]]:
    """`batches` (the loop's micro-batches, each optimizer step's `grad_accum` in a row) with `token_weight` set
    (`count`: the tokens a micro-batch's loss counts, the objective's `tokens`):
    `grad_accum * world_size` over the step's trained tokens on every rank (at least 1: a step with none trains
    nothing). Collective per step when `world_size` > 1: every rank runs the same steps (the plan's guarantee).
    Each counted and each yielded micro-batch is a move for the stall watchdog (core/stall.py), as each pulled one
    is in the loop without look-ahead: a step of many micro-batches (GRPO sampling them all first) is no stall."""
    stream = iter(batches)
    while True:
        step = list(islice(stream, grad_accum))
        if not step:
            return
        tokens = torch.tensor([float(sum(counted(count, batch) for batch in step))], dtype=torch.float64)
        if world_size > 1:
            all_reduce(tokens)
        weight = grad_accum * world_size / max(float(tokens), 1.0)
        for batch in step:
            batch["token_weight"] = weight
            stall.mark("compute")
            yield batch


def counted(count: Callable[[Dict[str, Any]], int], batch: Dict[str, Any]) -> int:
    stall.mark("compute")  # a move per micro-batch counted (GRPO samples it here)
    return count(batch)
