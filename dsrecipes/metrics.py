"""What a run reports: a rank-0 progress bar, `<run>/metrics.jsonl`, TensorBoard events in `<run>/tb/`, `loss.png`.

Only rank 0 writes. Numbers arrive already reduced over ranks (train.py does the all_reduce at log steps only, so
the hot loop never waits on a collective just to print). On resume, lines and events past the resumed step are
dropped, so a run killed after its last checkpoint leaves no duplicate steps behind.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

from dsrecipes.fileio import atomic_write_text, finite
from dsrecipes.rundir import METRICS_FILE, read_metrics

TB_DIR = "tb"
LOSS_PLOT = "loss.png"


@dataclass
class Window:
    """Per-rank sums since the last log line; `reduce()` turns them into global numbers (a collective call)."""

    loss_sum: Any = 0.0  # sum of micro-batch mean losses (a tensor: no device sync per micro-batch)
    micro_batches: int = 0
    tokens: int = 0  # real (non-pad) input tokens
    samples: int = 0
    started: float = 0.0
    excluded: float = 0.0  # seconds spent inside `paused()` (eval, checkpoints)

    def add(self, loss: torch.Tensor, batch: Dict[str, Any]) -> None:
        self.loss_sum = self.loss_sum + loss.detach().float()
        self.micro_batches += 1
        self.tokens += int(batch["num_tokens"])
        self.samples += len(batch["ids"])

    def reduce(self) -> Dict[str, float]:
        """{loss: mean micro-batch loss over all ranks, tokens, samples: summed over ranks, seconds}."""
        import torch.distributed as dist

        sums = torch.tensor([float(self.loss_sum), self.micro_batches, self.tokens, self.samples], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        loss_sum, micro_batches, tokens, samples = sums.tolist()
        seconds = max(time.perf_counter() - self.started - self.excluded, 1e-9)
        return {"loss": loss_sum / max(micro_batches, 1), "tokens": tokens, "samples": samples, "seconds": seconds,
                "micro_batches": micro_batches}

    def reset(self) -> None:
        self.loss_sum, self.micro_batches, self.tokens, self.samples = 0.0, 0, 0, 0
        self.started, self.excluded = time.perf_counter(), 0.0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in this block does not count towards tokens/s."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - start


class MetricsLogger:
    """Rank 0's sinks. Every method is a no-op on other ranks, so callers need no `if rank == 0`."""

    def __init__(self, run_dir: str | Path, rank: int, total_steps: int, start_step: int = 0, bar: bool = True):
        self.enabled = rank == 0
        self.run_dir = Path(run_dir)
        self.history: List[Dict[str, Any]] = []
        self._bar = None
        self._tb = None
        self._fh = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.history = truncate_metrics(self.run_dir / METRICS_FILE, start_step)
        self._fh = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        self._tb = open_tensorboard(self.run_dir / TB_DIR, start_step)
        if bar:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def step(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def log_train(self, step: int, loss: float, lr: float, grad_norm: Optional[float], tokens_per_s: float,
                  samples_seen: int, elapsed: float) -> None:
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "samples_seen": samples_seen, "elapsed": elapsed}
        self._write(record)
        if self._tb is not None:
            self._tb.add_scalar("train/loss", loss, step)
            self._tb.add_scalar("train/lr", lr, step)
            self._tb.add_scalar("train/tokens_per_s", tokens_per_s, step)
            if grad_norm is not None:
                self._tb.add_scalar("train/grad_norm", grad_norm, step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    def log_eval(self, step: int, eval_loss: float) -> None:
        self._write({"step": step, "eval_loss": eval_loss})
        if self._tb is not None:
            self._tb.add_scalar("eval/loss", eval_loss, step)
        if self._bar is not None:
            self._bar.write(f"step {step}: eval_loss {eval_loss:.4f}")

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Flush everything and draw loss.png from the whole history (resumed runs included)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._fh is not None:
            self._fh.close()
        plot_losses(self.history, self.run_dir / LOSS_PLOT)

    def _write(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.history.append(record)
        self._fh.write(json.dumps(finite(record)) + "\n")
        self._fh.flush()


def truncate_metrics(path: Path, last_step: int) -> List[Dict[str, Any]]:
    """Keep the lines up to `last_step` (atomically rewritten); returns them."""
    kept = [r for r in read_metrics(path) if r["step"] <= last_step]
    atomic_write_text(path, "".join(json.dumps(finite(r)) + "\n" for r in kept))
    return kept


def open_tensorboard(log_dir: Path, start_step: int):
    from torch.utils.tensorboard import SummaryWriter

    # purge_step hides events a killed run wrote past the checkpoint we resume from.
    return SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1 if start_step else None)


def plot_losses(history: List[Dict[str, Any]], out: Path) -> None:
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    if not train and not evals:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per predicted token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
