"""Loss pictures: a run's `loss.png` and a sweep's `summary.png` (every job's curves on one set of axes).

The y axis says what the loss is (`unit`: the objective's, observe/headline.py LOSS_UNITS: SFT's is a mean per
predicted token, DPO's a mean per preference pair). A run whose metrics hold headline numbers (headline.HEADLINE:
reward accuracy and margin of the preference objectives, GRPO's reward) gets one more panel per number under the
loss, train solid and evaluation dashed, on the same steps.

Fine-tuning losses fall by an order of magnitude in the first steps and then move by a few percent, so on a linear
axis the start flattens everything after it. When the plotted losses span more than 3x, the y axis is logarithmic
with plain tick labels (0.5, 1, 2, 5), which keeps both the drop and the tail readable.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from dsrecipes.core.fileio import atomic_write_bytes
from dsrecipes.observe.headline import HEADLINE

Curve = List[Tuple[int, float]]
LOG_SCALE_RATIO = 3.0


def curve(history: Sequence[Dict[str, Any]], key: str) -> Curve:
    """(step, value) of `key` in metrics.jsonl rows (non-finite values left out)."""
    def finite(v: Any) -> bool:
        return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")

    return [(r["step"], r[key]) for r in history if key in r and finite(r[key])]


def curves(history: Sequence[Dict[str, Any]]) -> Tuple[Curve, Curve]:
    """(train, eval) loss curves from metrics.jsonl rows (non-finite values left out)."""
    return curve(history, "loss"), curve(history, "eval_loss")


def plot_run(history: Sequence[Dict[str, Any]], out: Path, title: str = "", unit: str = "") -> bool:
    """loss.png of one run (`unit`: what its loss is); False when there is nothing to draw."""
    fig = run_figure(history, title, unit)
    if fig is not None:
        _save(fig, out)
    return fig is not None


def run_figure(history: Sequence[Dict[str, Any]], title: str = "", unit: str = "") -> Any:
    train, evals = curves(history)
    if not train and not evals:
        return None
    panels = [(n, label, spec) for n, label, spec in HEADLINE if curve(history, n) or curve(history, "eval_" + n)]
    plt = _pyplot()
    fig, axes = plt.subplots(1 + len(panels), 1, sharex=True, squeeze=False,
                             figsize=(8, 4.5 + 2.4 * len(panels)), gridspec_kw={"height_ratios": [2] + [1] * len(panels)})
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), color="tab:blue", lw=1.4, label=f"train loss (last {train[-1][1]:.4g})", **_lone(train))
    if evals:
        ax.plot(*zip(*evals), "o--", color="tab:orange", lw=1.2, ms=4, label=f"eval loss (last {evals[-1][1]:.4g})")
    _finish(ax, [v for _, v in train + evals], title, unit)
    ax.legend()
    for (key, label, spec), row in zip(panels, axes[1:]):
        _headline_panel(row[0], history, key, label, spec)
    if panels:
        for row in axes[:-1]:
            row[0].set_xlabel("")
    return fig


def _headline_panel(ax: Any, history: Sequence[Dict[str, Any]], key: str, label: str, spec: str) -> None:
    """One headline number (reward accuracy, margin, ...): train solid, evaluation dashed with markers."""
    from matplotlib.ticker import PercentFormatter

    train, evals = curve(history, key), curve(history, "eval_" + key)
    if train:
        ax.plot(*zip(*train), color="tab:green", lw=1.2, label=f"train {label}", **_lone(train))
    if evals:
        ax.plot(*zip(*evals), "o--", color="tab:red", lw=1.0, ms=3.5, label=f"eval {label}")
    if spec == "pct":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylabel(label.replace("_", " "))
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_sweep(jobs: Sequence[Tuple[str, Sequence[Dict[str, Any]]]], out: Path, title: str = "",
               unit: str = "") -> bool:
    """summary.png: (label, metrics rows) per job, one colour each; train solid, eval dashed with markers (`unit`:
    what the jobs' loss is, when they share an objective)."""
    fig = sweep_figure(jobs, title, unit)
    if fig is not None:
        _save(fig, out)
    return fig is not None


def sweep_figure(jobs: Sequence[Tuple[str, Sequence[Dict[str, Any]]]], title: str = "", unit: str = "") -> Any:
    drawn = [(label, *curves(rows)) for label, rows in jobs]
    drawn = [d for d in drawn if d[1] or d[2]]
    if not drawn:
        return None
    if len(drawn) < len(jobs):
        title += f" ({len(jobs) - len(drawn)} without metrics: see summary.md)"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    colours = plt.get_cmap("tab10" if len(drawn) <= 10 else "tab20")
    values: List[float] = []
    for i, (label, train, evals) in enumerate(drawn):
        colour = colours(i % colours.N)
        if train:
            ax.plot(*zip(*train), color=colour, lw=1.3, label=f"{label}: train", **_lone(train))
        if evals:
            ax.plot(*zip(*evals), "o--", color=colour, lw=1.0, ms=3.5, label=f"{label}: eval")
        values += [v for _, v in train + evals]
    _finish(ax, values, title, unit)
    ax.legend(fontsize="small", ncol=2 if len(drawn) > 6 else 1)
    return fig


def _lone(curve: Curve) -> Dict[str, Any]:
    """A curve of one point is a marker: a line through one point draws nothing (a run shorter than log_every)."""
    return {"marker": "o", "ms": 5} if len(curve) == 1 else {}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def use_log_scale(values: Sequence[float]) -> bool:
    """Log scale when every value is positive and they span more than LOG_SCALE_RATIO."""
    return bool(values) and min(values) > 0 and max(values) / min(values) > LOG_SCALE_RATIO


def loss_label(unit: str, log_scale: bool = False) -> str:
    """`loss (mean per preference pair, log scale)`, `loss` when the unit is unknown (a sweep of objectives)."""
    said = [w for w in (unit, "log scale" if log_scale else "") if w]
    return f"loss ({', '.join(said)})" if said else "loss"


def _finish(ax: Any, values: List[float], title: str, unit: str = "") -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xlabel("optimizer step")
    ax.set_ylabel(loss_label(unit))
    if use_log_scale(values):
        decades = math.log10(max(values) / min(values))
        subs = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0) if decades <= 1.2 else (1.0, 2.0, 3.0, 5.0, 7.0) \
            if decades <= 2 else (1.0, 2.0, 5.0)  # about 5-10 labelled ticks, whatever the span
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(loss_label(unit, log_scale=True))
    ax.grid(alpha=0.3, which="both")
    if title:
        ax.set_title(title, fontsize="medium")


def _save(fig: Any, out: Path) -> None:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
