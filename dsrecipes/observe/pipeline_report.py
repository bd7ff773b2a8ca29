"""The end of a pipeline: its stages side by side, as a table (console and `pipeline_summary.md`) and a picture
(`pipeline_summary.png`: every stage's eval loss, and each stage's accuracy at its start and end).

Read from the stages' run directories only (config.yaml for the objective, metrics.jsonl, result.json), so it
works for any objective: the accuracy column is the held-out pairwise accuracy where the stage reports one (a
reward model's `eval_pair_accuracy`, DPO's implicit `eval_reward_accuracy`), else the next-token accuracy of SFT.
Prompt-eval during training (`trainer.prompt_eval_every`) adds its exact-match share at the stage's start (the
model it was given: the base model for the first stage, the previous export after) and its end.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from dsrecipes.core.fileio import atomic_write_bytes, atomic_write_text
from dsrecipes.core.rundir import METRICS_FILE, read_metrics

SUMMARY_MD = "pipeline_summary.md"
SUMMARY_PNG = "pipeline_summary.png"
ACCURACY_KEYS = ("eval_pair_accuracy", "eval_reward_accuracy", "eval_accuracy")
PROMPT_KEY = "prompt_exact_match"


def write_summary(out: Path, stages: Sequence[Tuple[str, Path]], wall_s: float) -> str:
    """Write the table and the picture into `out`; returns the console text."""
    rows = [stage_row(name, run_dir) for name, run_dir in stages]
    table = render(rows)
    atomic_write_text(out / SUMMARY_MD, f"# pipeline {out.name}\n\n{table}\n")
    drawn = _plot(rows, out / SUMMARY_PNG)
    lines = [f"pipeline done: {len(rows)} stages in {wall_s:.0f}s", "", table, "",
             f"summary    {out / SUMMARY_MD}" + (f"\npicture    {out / SUMMARY_PNG}" if drawn else "")]
    return "\n".join(lines)


def stage_row(name: str, run_dir: Path) -> Dict[str, Any]:
    history = _metrics(run_dir)
    evals = [r for r in history if "eval_loss" in r]
    acc_key = next((k for k in ACCURACY_KEYS if any(k in r for r in evals)), None)
    prompts = [r[PROMPT_KEY] for r in history if isinstance(r.get(PROMPT_KEY), (int, float))]
    return {"stage": name, "objective": _objective(run_dir), "run_dir": str(run_dir), "history": history,
            "steps": max((r.get("step", 0) for r in history), default=0),
            "train_loss": _last(history, "loss"), "eval": [(r["step"], r["eval_loss"]) for r in evals],
            "accuracy_key": acc_key, "accuracy": [(r["step"], r[acc_key]) for r in evals if acc_key in r] if acc_key
            else [], "prompt_exact_match": (prompts[0], prompts[-1]) if prompts else None}


def render(rows: Sequence[Dict[str, Any]]) -> str:
    head = "| stage | objective | steps | train loss | eval loss (start -> end) | accuracy (start -> end) | prompts exact |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        acc = _span(r["accuracy"], "{:.1%}")
        acc = f"{acc} ({r['accuracy_key'].removeprefix('eval_')})" if r["accuracy_key"] else "-"
        prompt = r["prompt_exact_match"]
        lines.append(f"| {r['stage']} | {r['objective']} | {r['steps']} | {_fmt(r['train_loss'], '{:.4f}')} | "
                     f"{_span(r['eval'], '{:.4f}')} | {acc} | "
                     f"{f'{prompt[0]:.0%} -> {prompt[1]:.0%}' if prompt else '-'} |")
    return "\n".join(lines)


def _span(points: List[Tuple[int, float]], fmt: str) -> str:
    if not points:
        return "-"
    return fmt.format(points[-1][1]) if len(points) == 1 else f"{fmt.format(points[0][1])} -> {fmt.format(points[-1][1])}"


def _fmt(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _last(rows: Sequence[Dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return values[-1] if values else None


def _metrics(run_dir: Path) -> List[Dict[str, Any]]:
    try:
        return read_metrics(run_dir / METRICS_FILE)
    except Exception:  # noqa: BLE001 - a damaged or missing file: the row says so with dashes
        return []


def _objective(run_dir: Path) -> str:
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        return str(cfg["objective"]["kind"])
    except Exception:  # noqa: BLE001 - as above
        return "?"


def _plot(rows: Sequence[Dict[str, Any]], out: Path) -> bool:
    """Eval loss per stage (left; each stage on its own steps) and accuracy at start and end (right)."""
    if not any(r["eval"] for r in rows):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in rows:
        if r["eval"]:
            loss_ax.plot(*zip(*r["eval"]), "o-", ms=4, label=f"{r['stage']} ({r['objective']})")
    loss_ax.set(xlabel="optimizer step of the stage", ylabel="eval loss", title="eval loss per stage")
    loss_ax.legend(fontsize="small")
    names = [r["stage"] for r in rows]
    starts = [r["accuracy"][0][1] if r["accuracy"] else 0.0 for r in rows]
    ends = [r["accuracy"][-1][1] if r["accuracy"] else 0.0 for r in rows]
    x = range(len(rows))
    acc_ax.bar([i - 0.2 for i in x], starts, 0.4, label="start", color="tab:gray")
    acc_ax.bar([i + 0.2 for i in x], ends, 0.4, label="end", color="tab:green")
    acc_ax.set_xticks(list(x), [f"{n}\n{(r['accuracy_key'] or '-').removeprefix('eval_')}" for n, r in zip(names, rows)])
    acc_ax.set(ylim=(0, 1), title="held-out accuracy per stage")
    acc_ax.axhline(0.5, color="tab:red", lw=0.8, ls="--")
    acc_ax.legend(fontsize="small")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(out, buf.getvalue())
    return True
