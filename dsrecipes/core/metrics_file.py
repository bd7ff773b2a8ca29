"""metrics.jsonl of a run directory: reading it (bounded, each bad line named) and the run's headline numbers.

Owner: core/. `rundir` re-exports these names (METRICS_FILE, read_metrics, run_summary) for its callers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import loads_bounded

METRICS_FILE = "metrics.jsonl"
MAX_METRICS_BYTES = 512 << 20  # about two million log lines of a few hundred bytes (log_every steps each)
MAX_METRICS_LINE = 1 << 20  # one log line: a flat record of numbers


def read_metrics(path: str | Path) -> List[Dict[str, Any]]:
    """The lines of metrics.jsonl (a run directory or the file): each a JSON object with an integer `step`. The last
    line, cut short by a killed run (no newline at its end), is skipped; any other line that is not such a record
    is UserError naming file:line (a run resumed onto it would crash or mix its history), as is a file of more than
    MAX_METRICS_BYTES or a line of more than MAX_METRICS_LINE (read line by line, never whole)."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        return []
    fix = "repair or remove that line (or move the file away) and run again"
    rows = []
    for number, line in _metric_lines(path, fix):
        if not line.strip():
            continue
        try:
            row = loads_bounded(line, "JSON nested too deeply")  # bytes: decoded as UTF-8
        except ValueError as exc:  # also UnicodeDecodeError
            if not line.endswith(b"\n"):  # after the last newline: a write cut short
                continue
            raise UserError(f"{path}:{number}: not a metrics record ({type(exc).__name__}: {str(exc)[:80]}); "
                            f"{fix}") from None
        if not isinstance(row, dict) or type(row.get("step")) is not int:
            raise UserError(f"{path}:{number}: not a metrics record (a JSON object with an integer \"step\"); {fix}")
        rows.append(row)
    return rows


def _metric_lines(path: Path, fix: str) -> Iterator[Tuple[int, bytes]]:
    """(number, line) of metrics.jsonl, read line by line within MAX_METRICS_BYTES and MAX_METRICS_LINE."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        for number, line in enumerate(iter(lambda: fh.readline(MAX_METRICS_LINE + 1), b""), 1):
            if max(size, fh.tell()) > MAX_METRICS_BYTES:  # (checked before the first line is kept)
                raise UserError(f"{path}: more than {MAX_METRICS_BYTES >> 20} MiB, more than dsrecipes reads of a "
                                "run's metrics (about two million log lines); move the file away and run again")
            if len(line) > MAX_METRICS_LINE:
                raise UserError(f"{path}:{number}: a line of more than {MAX_METRICS_LINE >> 20} MiB, not a metrics "
                                f"record; {fix}")
            yield number, line


def run_summary(run_dir: Path) -> Dict[str, Any]:
    """Headline numbers from metrics.jsonl: steps, final train/eval loss, tokens/s (without the first log window,
    which includes warm-up): all the windows' tokens over all their training time (`mean_rate`)."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return {
        "steps": train[-1]["step"] if train else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s": mean_rate(train),
    }


def mean_rate(train: List[Dict[str, Any]]) -> Optional[float]:
    """Tokens over time of the log windows but each attempt's first (the file's first, and a resumed attempt's,
    marked `warmup`: it warms up again): a window's time is its tokens / its rate. Where a line
    has no `tokens` (written before it was logged: a run resumed across that change too), every window weighs by
    its steps (equal tokens per step; never tokens for some windows and steps for others). Not the plain mean of the
    rates, which weighs a short fast window as much as a long slow one. A value that is no positive number (a file
    handed over) leaves its window out."""
    timed = [r for r in train if _positive(r.get("tokens_per_s"))]
    by_tokens = all(_positive(r.get("tokens")) for r in timed)
    windows, previous = [], 0
    for r in train:
        rate = r.get("tokens_per_s")
        weight = r.get("tokens") if by_tokens else r["step"] - previous
        previous = r["step"]
        if _positive(rate) and _positive(weight):
            windows.append((weight, weight / rate, r.get("warmup") is True or not windows))
    kept = [w[:2] for w in windows if not w[2]] or [w[:2] for w in windows]
    seconds = sum(s for _, s in kept)
    return sum(w for w, _ in kept) / seconds if seconds > 0 else None


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
