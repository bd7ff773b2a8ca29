"""Where a LLaMA-Factory key's twin here trains otherwise, said in the key's line (config/foreign_keys.RULES): the
texts, kept apart so that the table stays a table."""

from __future__ import annotations

from typing import Any

PACKING = ("data.packing: true (packed samples attend only within themselves here, as with LLaMA-Factory's "
           "neat_packing; its packing alone lets them attend to each other)")
MASK_HISTORY = ("data.train_on: last_assistant (only the final assistant turn; a conversation longer than "
                "data.cutoff_len keeps its head here, so one whose last reply starts past it is dropped, where "
                "LLaMA-Factory's mask_history keeps the last turn and cuts the history)")
GRAD_ACCUM = (" (the step's loss here is the mean of its micro-batches' mean losses, each micro-batch counting the same; "
              "LLaMA-Factory's Trainer (transformers >= 4.46) divides the step's summed loss by all its trained tokens, "
              "so with rows of unequal length its gradients differ)")


def grad_accum(value: Any) -> str:
    """What `gradient_accumulation_steps: N` adds to `trainer.grad_accum: N`: how a step of N > 1 micro-batches
    weighs their losses (LF's Trainer: num_items_in_batch)."""
    return GRAD_ACCUM if isinstance(value, int) and not isinstance(value, bool) and value > 1 else ""
