"""The learning-rate schedule: a closed form per optimizer step, and the scheduler object DeepSpeed steps.

Optimizer step s (1-based) of a run of T steps with W warmup steps (scheduler.warmup_steps, or
ceil(scheduler.warmup_ratio x T) when the ratio is set) trains at `lr * factor(s)`:

    warmup (s <= W):   s / W                  step 1 already trains (lr / W), step W at the peak
    after (s > W):     p = (s - 1 - W) / (T - W)   in [0, 1): the first step after warmup at the peak, the last
                       step still above the floor m = scheduler.min_lr_ratio
        constant:      1
        linear:        m + (1 - m) * (1 - p)
        cosine:        m + (1 - m) * (1 + cos(pi * p)) / 2

So no step trains at lr 0 (DeepSpeed's WarmupLR/WarmupCosineLR start at 0 and waste the first step), W = 0 starts
at the peak, and a warmup longer than the run is clamped to the run (`warmup_steps()` says so in one line).

The schedule is a pure function of (step, T): DeepSpeed is given our scheduler object (`lr_scheduler=`), which it
steps after every optimizer step and saves in its checkpoints; on resume `resume_at(step)` applies the schedule of
the *current* run (e.g. a larger `trainer.max_steps`) from the first resumed step, whatever the checkpoint held.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from dsrecipes.core.schema import SchedulerConfig, SchedulerKind


def warmup_steps(cfg: SchedulerConfig, total_steps: int) -> Tuple[int, Optional[str]]:
    """(warmup steps used, a one-line note when the configured warmup had to be clamped to the run).
    `scheduler.warmup_ratio`, when set, replaces `warmup_steps`: ceil(ratio x T) steps (Hugging Face's and
    LLaMA-Factory's rounding), computed from the current run's T (a resumed run with a larger budget warms up
    over its share of the new T)."""
    if cfg.warmup_ratio is not None:
        return min(math.ceil(cfg.warmup_ratio * total_steps), total_steps), None
    if cfg.warmup_steps <= total_steps:
        return cfg.warmup_steps, None
    return total_steps, (f"note: scheduler.warmup_steps={cfg.warmup_steps} is longer than the run's {total_steps} "
                         f"optimizer steps; warming up over all {total_steps}")


def lr_factor(cfg: SchedulerConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak lr for optimizer step `step` (1-based) of a run of `total_steps`."""
    warmup, _ = warmup_steps(cfg, total_steps)
    if step <= warmup:
        return step / warmup
    if cfg.name is SchedulerKind.constant:
        return 1.0
    progress = (step - 1 - warmup) / (total_steps - warmup)
    floor = cfg.min_lr_ratio
    if cfg.name is SchedulerKind.linear:
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * (1.0 + math.cos(math.pi * progress)) / 2.0


class StepScheduler:
    """Sets every param group's lr for the next optimizer step; DeepSpeed calls `step()` after each one.

    `state_dict()` is what DeepSpeed writes into its checkpoints (steps done and the run length it served);
    loading it restores the position, and `resume_at` re-applies the current schedule after a checkpoint load.
    """

    def __init__(self, optimizer: Any, cfg: SchedulerConfig, peak_lr: float, total_steps: int):
        self.optimizer = optimizer
        self.cfg = cfg
        self.peak_lr = peak_lr
        self.total_steps = total_steps
        self.done = 0  # optimizer steps taken
        self._apply()

    def step(self, *_: Any, **__: Any) -> None:
        self.done += 1
        self._apply()

    def resume_at(self, steps_done: int) -> None:
        self.done = steps_done
        self._apply()

    def lr_at(self, step: int) -> float:
        return self.peak_lr * lr_factor(self.cfg, step, self.total_steps)

    def get_last_lr(self) -> List[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_lr(self) -> List[float]:
        return self.get_last_lr()

    def state_dict(self) -> Dict[str, Any]:
        return {"done": self.done, "total_steps": self.total_steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if "done" in state:  # (a checkpoint from before this scheduler holds DeepSpeed's; train.py re-applies anyway)
            self.resume_at(int(state["done"]))

    def _apply(self) -> None:
        lr = self.lr_at(min(self.done + 1, self.total_steps))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
