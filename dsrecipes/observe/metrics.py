"""What a run reports: rank 0's progress (a bar on a terminal, one line per log step otherwise: console.py),
`<run>/metrics.jsonl`, the experiment trackers of `trainer.report_to` (trackers.py: TensorBoard in `<run>/tb/` by
default, MLflow, W&B) and `loss.png` (plots.py).

Only rank 0 writes. Numbers arrive already reduced over ranks (train.py does the all_reduce at log steps only, so
the hot loop never waits on a collective just to print). On resume, lines and events past the resumed step are
dropped, so a run killed after its last checkpoint leaves no duplicate steps behind.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsrecipes.core.console import progress_mode
from dsrecipes.core.fileio import atomic_write_text, finite, open_append
from dsrecipes.core.rundir import CONFIG_FILE, METRICS_FILE, read_metrics
from dsrecipes.observe.headline import inline, loss_unit, shown
from dsrecipes.observe.plots import plot_run
from dsrecipes.observe.trackers import call_each, open_trackers

LOSS_PLOT = "loss.png"



class MetricsLogger:
    """Rank 0's sinks. Every method is a no-op on other ranks, so callers need no `if rank == 0`.

    `bar`: a tqdm bar (True), one plain line per log step (False), or the console's choice (None: a bar on a
    terminal). `cfg` names the trackers (`trainer.report_to`); without it, TensorBoard only."""

    def __init__(self, run_dir: str | Path, rank: int, total_steps: int, start_step: int = 0,
                 bar: Optional[bool] = None, cfg: Any = None):
        self.enabled = rank == 0
        self.run_dir = Path(run_dir)
        self.history: List[Dict[str, Any]] = []
        self.total_steps, self.start_step, self.started = total_steps, start_step, time.perf_counter()
        self.loss_unit = loss_unit(getattr(getattr(cfg, "objective", None), "kind", None))  # loss.png's y label
        self._bar = None
        self._warm = start_step == 0  # (a resumed attempt's first window includes its start: `warmup`, log_train)
        self._fh = None
        self._trackers: List[Any] = []
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.history = truncate_metrics(self.run_dir / METRICS_FILE, start_step)
        self._fh = open_append(self.run_dir / METRICS_FILE)
        self._trackers = open_trackers(cfg, self.run_dir, start_step)
        if bar if bar is not None else progress_mode() == "bar":
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def step(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def log_train(self, step: int, loss: float, lr: float, grad_norm: Optional[float], tokens_per_s: float,
                  samples_seen: int, elapsed: float, extra: Optional[Dict[str, float]] = None,
                  tokens: Optional[int] = None) -> None:
        """`extra`: the objective's other train metrics (DPO: rewards, reward accuracy, margin); those of
        headline.HEADLINE are shown beside the loss."""
        extra = extra or {}
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "samples_seen": samples_seen, "elapsed": elapsed, **extra}
        if tokens is not None:  # the window's real tokens over all ranks: run_summary weighs windows by them
            record["tokens"] = tokens
        if not self._warm:  # a resume's first window: warm-up again, left out of the run's tokens/s as the first is
            record["warmup"], self._warm = True, True
        self._write(record)
        scalars = {"train/loss": loss, "train/lr": lr, "train/tokens_per_s": tokens_per_s,
                   **{f"train/{k}": v for k, v in extra.items()}}
        if grad_norm is not None:
            scalars["train/grad_norm"] = grad_norm
        self._track(scalars, step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", **dict(shown(extra)), lr=f"{lr:.2e}",
                                  tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        elif self.enabled:
            grad = "" if grad_norm is None else f"  grad_norm {grad_norm:.3f}"
            print(f"{self._where(step)}  loss {loss:.4f}{inline(extra)}  lr {lr:.2e}{grad}  {tokens_per_s:,.0f} "
                  f"tok/s  {self._eta(step)}", flush=True)

    def log_eval(self, step: int, values: float | Dict[str, float]) -> None:
        """One evaluation: `eval_loss` (a bare float), or the numbers of evaluation.EvalResult.metrics() /
        prompt-eval (`eval_*`, `prompt_*` keys; trackers get them as `eval/*`, `prompt/*`)."""
        values = {"eval_loss": values} if not isinstance(values, dict) else values
        self._write({"step": step, **values})
        self._track({"/".join(key.split("_", 1)): v for key, v in values.items() if v is not None}, step)
        self.info(f"{self._where(step)}  {describe_eval(values)}")

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:  # the bar's own stream: through a launcher's pipes, one stream keeps the order
            self._bar.write(message, file=self._bar.fp)
        else:
            print(message, flush=True)

    def close(self, ok: bool = True) -> None:
        """Flush everything, draw loss.png from the whole history (resumed runs included), hand it and config.yaml
        to the trackers and close them (`ok`: the run finished)."""
        if not self.enabled:
            return
        try:
            self._close(ok)
        except OSError:
            if ok:
                raise
            # a failed run (a full disk fails these writes too): its own error stands, not this later one

    def _close(self, ok: bool) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._fh is not None:
            self._fh.close()

        artifacts = [self.run_dir / name for name in (LOSS_PLOT, CONFIG_FILE)]
        plot_run(self.history, artifacts[0], title=f"{self.run_dir.parent.name}/{self.run_dir.name}",
                 unit=self.loss_unit)
        self._trackers = call_each(self._trackers, "log_artifacts", [p for p in artifacts if p.is_file()],
                                   stop_on_full=ok)
        self._trackers = call_each(self._trackers, "close", ok, stop_on_full=ok)

    def _track(self, scalars: Dict[str, float], step: int) -> None:
        if self._trackers:
            self._trackers = call_each(self._trackers, "log_metrics", scalars, step)

    def _where(self, step: int) -> str:
        width = len(str(self.total_steps))
        return f"step {step:>{width}}/{self.total_steps}"

    def _eta(self, step: int) -> str:
        done = step - self.start_step
        spent = time.perf_counter() - self.started
        left = spent / done * (self.total_steps - step) if done > 0 else 0.0
        return f"elapsed {format_seconds(spent)}  eta {format_seconds(left)}"

    def _write(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.history.append(record)
        self._fh.write(json.dumps(finite(record)) + "\n")
        self._fh.flush()


def describe_eval(values: Dict[str, Any]) -> str:
    """`eval_loss 1.2345  ppl 3.44  accuracy 41.2%  prompts: similarity 0.512  exact 25.0%  ended 100.0%`; a
    preference objective's `eval_loss 0.6812  reward_acc 62.5%  margin 0.0310` (headline.py)."""
    parts = []
    if values.get("eval_loss") is not None:
        parts.append(f"eval_loss {values['eval_loss']:.4f}")
    parts += [f"{label} {text}" for label, text in shown(values, "eval_")]
    if values.get("eval_ppl") is not None:
        parts.append(f"ppl {values['eval_ppl']:.4g}")
    if values.get("eval_accuracy") is not None:
        parts.append(f"accuracy {values['eval_accuracy']:.1%}")
    if values.get("prompt_similarity") is not None:
        parts.append(f"prompts: similarity {values['prompt_similarity']:.3f}  exact "
                     f"{values.get('prompt_exact_match', 0.0):.1%}  ended {values.get('prompt_ended', 0.0):.1%}")
    return "  ".join(parts)


def format_seconds(seconds: float) -> str:
    """`42s`, `3m07s`, `2h05m`."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def truncate_metrics(path: Path, last_step: int) -> List[Dict[str, Any]]:
    """Keep the lines up to `last_step` (atomically rewritten); returns them."""
    kept = [r for r in read_metrics(path) if r["step"] <= last_step]
    atomic_write_text(path, "".join(json.dumps(finite(r)) + "\n" for r in kept))
    return kept
