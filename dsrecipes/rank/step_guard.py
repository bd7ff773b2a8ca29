"""What every rank must agree on at an optimizer-step boundary: was any loss of this step non-finite, and was the run
asked to stop. One tiny all-reduce per step (nothing for a lone rank), before the optimizer step, so all ranks
drop the same step and stop at the same step, and the collectives of a save never pair up with a training step.

A non-finite step is never applied: `trainer.nan_policy=stop` ends the run before the update (so no checkpoint or
export holds its weights); `skip` drops the update (`discard_step`) and counts it, and ends the run after
`trainer.nan_max_skips` of them in a row.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

from dsrecipes.core.distributed import all_reduce
from dsrecipes.core.errors import TrainingFailed


class StepGuard:
    """Collects a step's micro-batch losses, then `agree()`s with the other ranks at the boundary."""

    def __init__(self, world_size: int, device: Any, rank: int):
        self.world_size = world_size
        self.device = device
        self.rank = rank
        self.pending: List[Tuple[torch.Tensor, Any]] = []  # (loss, batch) of this step, for the log window
        self._bad = torch.zeros((), dtype=torch.bool, device=device)
        self.skipped_in_a_row = 0

    def add(self, loss: torch.Tensor, batch: Any, step: int) -> torch.Tensor:
        """Record a micro-batch loss of optimizer step `step` (no device sync); returns the loss to train on."""
        self._bad |= ~torch.isfinite(loss.detach())
        self.pending.append((loss, batch))
        return loss

    def agree(self, stop_requested: bool) -> Tuple[bool, bool]:
        """Collective: (some loss of this step was non-finite on some rank, some rank was asked to stop)."""
        flags = torch.stack([self._bad.to(torch.int64), torch.tensor(int(stop_requested), device=self.device)])
        if self.world_size > 1:
            all_reduce(flags, "MAX")
        self._bad.zero_()
        bad, stop = (bool(v) for v in flags.tolist())
        return bad, stop

    def take_pending(self) -> List[Tuple[torch.Tensor, Any]]:
        pending, self.pending = self.pending, []
        return pending


def nonfinite(policy_skip: bool, guard: StepGuard, step: int, max_skips: int) -> None:
    """Called when step `step` had a non-finite loss: raise for `stop` (or too many skips in a row)."""
    if not policy_skip:
        raise TrainingFailed(
            f"non-finite loss (NaN/Inf) at step {step}; the run stopped before applying that step, so no checkpoint "
            "or export holds its weights (trainer.nan_policy=stop). Lower optimizer.lr, check the data, or set "
            "trainer.nan_policy=skip to drop such steps", step)
    guard.skipped_in_a_row += 1
    if guard.skipped_in_a_row >= max_skips:
        raise TrainingFailed(
            f"non-finite loss at {guard.skipped_in_a_row} steps in a row (up to step {step}; "
            f"trainer.nan_max_skips={max_skips}): the run cannot recover by skipping steps", step)


def discard_step(engine: Any, step: int) -> None:
    """Close the step without applying its gradients (they are non-finite on every rank after the reduction)."""
    if hasattr(engine.optimizer, "overflow"):
        # DeepSpeed's own optimizers (ZeRO, bf16, fp16) drop a step whose gradients are not finite by themselves.
        engine.step()
        if engine.was_step_applied():
            raise TrainingFailed(f"step {step} had a non-finite loss and this optimizer applied it anyway; the run "
                                 "stopped (use trainer.nan_policy=stop)", step)
        return
    # A bare torch optimizer has no such check: its step is suppressed for this one call (no moments, no decay, no
    # step count), while the engine still closes the step (micro-step counters, scheduler). Gradients are zeroed
    # first so that gradient clipping computes a finite norm.
    optimizer = engine.optimizer
    for param in engine.module.parameters():
        if param.grad is not None:
            param.grad.zero_()
    shadowed = vars(optimizer).get("step")
    optimizer.step = lambda *args, **kwargs: None
    try:
        engine.step()
    finally:
        if shadowed is None:
            del optimizer.step
        else:
            optimizer.step = shadowed
