"""Loss pictures: a run's `loss.png` and a sweep's `summary.png` (every job's curves on one set of axes).

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

Curve = List[Tuple[int, float]]
LOG_SCALE_RATIO = 3.0


def curves(history: Sequence[Dict[str, Any]]) -> Tuple[Curve, Curve]:
    """(train, eval) loss curves from metrics.jsonl rows (non-finite values left out)."""
    def finite(v: Any) -> bool:
        return isinstance(v, (int, float)) and v == v and abs(v) != float("inf")

    train = [(r["step"], r["loss"]) for r in history if "loss" in r and finite(r["loss"])]
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r and finite(r["eval_loss"])]
    return train, evals


def plot_run(history: Sequence[Dict[str, Any]], out: Path, title: str = "") -> bool:
    """loss.png of one run; False when there is nothing to draw."""
    fig = run_figure(history, title)
    if fig is not None:
        _save(fig, out)
    return fig is not None


def run_figure(history: Sequence[Dict[str, Any]], title: str = "") -> Any:
    train, evals = curves(history)
    if not train and not evals:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot(*zip(*train), color="tab:blue", lw=1.4, label=f"train loss (last {train[-1][1]:.4g})", **_lone(train))
    if evals:
        ax.plot(*zip(*evals), "o--", color="tab:orange", lw=1.2, ms=4, label=f"eval loss (last {evals[-1][1]:.4g})")
    _finish(ax, [v for _, v in train + evals], title)
    ax.legend()
    return fig


def plot_sweep(jobs: Sequence[Tuple[str, Sequence[Dict[str, Any]]]], out: Path, title: str = "") -> bool:
    """summary.png: (label, metrics rows) per job, one colour each; train solid, eval dashed with markers."""
    fig = sweep_figure(jobs, title)
    if fig is not None:
        _save(fig, out)
    return fig is not None


def sweep_figure(jobs: Sequence[Tuple[str, Sequence[Dict[str, Any]]]], title: str = "") -> Any:
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
    _finish(ax, values, title)
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


def _finish(ax: Any, values: List[float], title: str) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per predicted token)")
    if use_log_scale(values):
        decades = math.log10(max(values) / min(values))
        subs = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0) if decades <= 1.2 else (1.0, 2.0, 3.0, 5.0, 7.0) \
            if decades <= 2 else (1.0, 2.0, 5.0)  # about 5-10 labelled ticks, whatever the span
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("loss (mean per predicted token, log scale)")
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
