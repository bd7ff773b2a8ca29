"""What a run shows of its objective besides the loss, and what its loss is: one table for the step lines and the
progress bar (metrics.py), the evaluation lines, the closing summary (report.py) and loss.png (plots.py).

Shown by name, not by objective: every objective reports its numbers through `objective.metrics()` (train metrics
without a prefix, evaluation with `eval_`), and whatever of HEADLINE a run's numbers hold is shown - the preference
objectives' reward accuracy and margin (DPO, IPO, SimPO, ORPO, objective=reward), GRPO's mean reward. A new
objective that reports `reward_accuracy` gets it on the console, in the summary and in loss.png without a change
here. The y-axis label of loss.png says what the loss is: LOSS_UNITS, one line per `ObjectiveKind`
(tests/test_reward_display.py checks every kind has one; DPO's loss variants share it).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from dsrecipes.core.choices import ObjectiveKind

# (metric name, label on the console and in the summary, format: "pct" or a format spec)
HEADLINE: Tuple[Tuple[str, str, str], ...] = (
    ("reward_accuracy", "reward_acc", "pct"),
    ("reward_margin", "margin", ".4f"),
    ("reward", "reward", ".4f"),
)

LOSS_UNITS: Dict[ObjectiveKind, str] = {
    ObjectiveKind.sft: "mean per predicted token",
    ObjectiveKind.dpo: "mean per preference pair",
    ObjectiveKind.orpo: "chosen NLL per token + beta x odds-ratio term, per pair",
    ObjectiveKind.reward: "-log sigmoid(r_chosen - r_rejected), mean per pair",
    ObjectiveKind.grpo: "clipped policy loss per completion token",
}


def fmt(value: float, spec: str) -> str:
    return f"{value:.1%}" if spec == "pct" else format(value, spec)


def shown(values: Mapping[str, Any], prefix: str = "") -> List[Tuple[str, str]]:
    """[(label, formatted value)] of the HEADLINE metrics `values` holds (`prefix`: "eval_" for evaluations)."""
    out = []
    for name, label, spec in HEADLINE:
        value = values.get(prefix + name)
        if isinstance(value, (int, float)) and value == value:
            out.append((label, fmt(float(value), spec)))
    return out


def inline(values: Mapping[str, Any], prefix: str = "") -> str:
    """`  reward_acc 62.5%  margin 0.0123` ('' when there is nothing to show)."""
    return "".join(f"  {label} {text}" for label, text in shown(values, prefix))


def logged(rows: List[Mapping[str, Any]], prefix: str = "") -> List[Tuple[str, str, str]]:
    """[(metric key, label, format)] of the HEADLINE metrics any of `rows` holds, in HEADLINE order."""
    return [(prefix + name, label, spec) for name, label, spec in HEADLINE
            if any(isinstance(r.get(prefix + name), (int, float)) for r in rows)]


def loss_unit(kind: Optional[Any]) -> str:
    """What the loss of objective `kind` (an ObjectiveKind or its value) is; "" when unknown (a sweep of several)."""
    try:
        return LOSS_UNITS[ObjectiveKind(kind)] if kind is not None else ""
    except ValueError:
        return ""
