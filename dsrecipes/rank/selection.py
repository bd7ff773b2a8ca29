"""Model selection from evaluations: the best checkpoint (`trainer.save_best`) and early stopping
(`trainer.early_stopping`) (their config rules: config/selection_rules.py).

The state is a plain dict inside `TrainState.selection` (checkpoint client state), so a resumed run continues with
the same best step, best value and patience counter as an uninterrupted one:

    {"best_step": int | None, "best_value": float | None, "bad_evals": int, "stopped": str | None,
     "earlier_stops": [{"step": int, "reason": str}]}   # stops a resume with a larger budget continued past

Rules, applied to every evaluation after step 0 (the step-0 evaluation is the starting point, not a candidate):
- better: strictly better than the best so far in the metric's direction (`save_best.mode`, or the metric's own);
  the best checkpoint moves there (that step is checkpointed even between `trainer.save_every` steps);
- an improvement by more than `early_stopping.min_delta` resets the patience counter; anything else (a non-finite
  value too) counts one; `early_stopping.patience` in a row end the run at that step, with a checkpoint and export.

No torch here: the launching process validates configs with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from dsrecipes.core.schema import SelectMetric, SelectMode, TrainConfig

# The direction of each metric (completeness: tests/test_selection.py).
METRIC_MODES: Dict[SelectMetric, SelectMode] = {
    SelectMetric.eval_loss: SelectMode.min,
    SelectMetric.eval_ppl: SelectMode.min,
    SelectMetric.eval_accuracy: SelectMode.max,
    SelectMetric.prompt_exact_match: SelectMode.max,
    SelectMetric.prompt_similarity: SelectMode.max,
    SelectMetric.prompt_ended: SelectMode.max,
}


def fresh_state() -> Dict[str, Any]:
    return {"best_step": None, "best_value": None, "bad_evals": 0, "stopped": None, "earlier_stops": []}


def _whole(value: Any) -> bool:
    return type(value) is int and 0 <= value <= 2**53


_FIELDS = {  # what `observe` and `_continue_past_stop` write, each value's type
    "best_step": lambda v: v is None or _whole(v),
    "best_value": lambda v: v is None or (type(v) in (int, float) and math.isfinite(v)),
    "bad_evals": _whole,
    "stopped": lambda v: v is None or isinstance(v, str),
    "stopped_step": lambda v: v is None or _whole(v),
    "earlier_stops": lambda v: isinstance(v, list) and all(
        isinstance(e, dict) and set(e) <= {"step", "reason"} and (e.get("step") is None or _whole(e["step"]))
        and (e.get("reason") is None or isinstance(e["reason"], str)) for e in v),
}


def check_state(state: Any) -> None:
    """ValueError unless `state` (a checkpoint's TrainState.selection: a trusted foreign checkpoint's is data) holds
    only the keys this module writes, each of its type; checked where it is loaded, before the run uses it."""
    if not isinstance(state, dict):
        raise ValueError(f"selection must be an object, got {type(state).__name__}")
    for key, value in state.items():
        if key not in _FIELDS or not _FIELDS[key](value):
            raise ValueError(f"selection.{str(key)[:40]} is not a value dsrecipes writes there: {str(value)[:40]}")


@dataclass(frozen=True)
class Verdict:
    improved: bool  # a new best: checkpoint this step (save_best)
    stop: Optional[str]  # why the run ends here (early stopping), or None


class Selector:
    """Applies the rules to `state` (TrainState.selection, updated in place) as evaluations arrive."""

    def __init__(self, cfg: TrainConfig, state: Dict[str, Any], past_stop: bool = False):
        t = cfg.trainer
        self.metric = t.save_best.metric
        self.mode = t.save_best.mode or METRIC_MODES[self.metric]
        self.save_best = t.save_best.enabled
        self.patience, self.min_delta = t.early_stopping.patience, t.early_stopping.min_delta
        for key, value in fresh_state().items():
            state.setdefault(key, value)
        self.state = state
        if state["stopped"] and past_stop:
            self._continue_past_stop()

    def _continue_past_stop(self) -> None:
        """A resume of a run that stopped early, asked to go on (a larger budget or other early stopping: the
        launching side decides, run/resume_contract.check_budget): the stop goes to `earlier_stops` (result.json
        keeps it) and patience counts afresh from here."""
        st = self.state
        st["earlier_stops"] = [*st["earlier_stops"], {"step": st.get("stopped_step"), "reason": st["stopped"]}]
        st["stopped"], st["bad_evals"] = None, 0

    @property
    def active(self) -> bool:
        return self.save_best or self.patience > 0

    def observe(self, step: int, metrics: Dict[str, float]) -> Verdict:
        """One evaluation's numbers (those without this metric, and step 0, change nothing)."""
        value = metrics.get(self.metric.value)
        if not self.active or step == 0 or value is None:
            return Verdict(False, None)
        st = self.state
        finite = math.isfinite(value)
        best = st["best_value"]
        better = finite and (best is None or self._gain(value, best) > 0)
        significant = finite and (best is None or self._gain(value, best) > self.min_delta)
        if better:
            st["best_step"], st["best_value"] = step, float(value)
        st["bad_evals"] = 0 if significant else st["bad_evals"] + 1
        if self.patience > 0 and st["bad_evals"] >= self.patience:
            st["stopped_step"] = step
            st["stopped"] = (f"early stopping: {self.metric.value} did not improve by more than {self.min_delta:g} "
                             f"for {st['bad_evals']} evaluation(s) (best {st['best_value']} at step "
                             f"{st['best_step']})")
        return Verdict(better and self.save_best, st["stopped"])

    def _gain(self, value: float, best: float) -> float:
        return best - value if self.mode is SelectMode.min else value - best

    def protected(self) -> List[str]:
        """Checkpoint tags retention must keep: the best one (save_best)."""
        step = self.state.get("best_step")
        return [f"step_{step}"] if self.save_best and step is not None else []

    def outcome(self) -> Dict[str, Any]:
        """What result.json records (via rank_outcome.json)."""
        out: Dict[str, Any] = {}
        if self.save_best:
            out.update(best_metric=self.metric.value, best_step=self.state["best_step"],
                       best_value=self.state["best_value"])
        if self.patience > 0:
            out["stopped_early"] = self.state["stopped"]
        if self.state["earlier_stops"]:  # stops of earlier segments this run continued past
            out["earlier_stops"] = list(self.state["earlier_stops"])
        return out
