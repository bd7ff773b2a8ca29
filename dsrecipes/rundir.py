"""The run directory's files: what the launching process writes for the ranks, and what a finished run leaves.

    config.yaml     the resolved TrainConfig (ranks read it; never re-composed)
    plan.json       the run plan (runplan.py)
    ds_config.json  the DeepSpeed dict for the plan's world size (ds_config.py)
    launch.txt      the launch commands (launch/)
    metrics.jsonl   train/eval lines (metrics.py)
    result.json     status and headline numbers, for people and sweep summaries (sweep.py)

Every file goes through the one atomic-write helper (fileio.py). `run_summary()` is the one place that turns
metrics.jsonl into headline numbers, for result.json and the sweep table alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsrecipes.errors import UserError
from dsrecipes.fileio import atomic_write_json, atomic_write_text

CONFIG_FILE = "config.yaml"
DS_CONFIG_FILE = "ds_config.json"
METRICS_FILE = "metrics.jsonl"
RESULT_FILE = "result.json"


def write_config(run_dir: Path, data: Dict[str, Any]) -> Path:
    import yaml

    return atomic_write_text(run_dir / CONFIG_FILE, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def write_ds_config(run_dir: Path, ds_config: Dict[str, Any]) -> Path:
    return atomic_write_json(run_dir / DS_CONFIG_FILE, ds_config)


def read_ds_config(run_dir: Path) -> Dict[str, Any]:
    """The DeepSpeed dict the launching process wrote for the real world size (ranks never rebuild it)."""
    path = Path(run_dir) / DS_CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{path}: missing; start runs with `python -m dsrecipes` (it writes the run directory)")
    return json.loads(path.read_text(encoding="utf-8"))


def read_metrics(path: str | Path) -> List[Dict[str, Any]]:
    """The lines of metrics.jsonl (a run directory or the file); a line cut short by a killed run is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def run_summary(run_dir: Path) -> Dict[str, Any]:
    """Headline numbers from metrics.jsonl: steps, final train/eval loss, mean tokens/s (without the first log
    window, which includes warm-up)."""
    rows = read_metrics(run_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    speeds = [r["tokens_per_s"] for r in train[1:] or train if r.get("tokens_per_s") is not None]
    return {
        "steps": train[-1]["step"] if train else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
    }


def write_result(run_dir: Path, code: int, error: Optional[str], status: str = "ok") -> Path:
    """<run>/result.json: status, exit code, error, the headline numbers and peak resident memory."""
    import resource

    peak_kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    result: Dict[str, Any] = {"status": status if code == 0 else "failed", "exit_code": code, "error": error}
    result.update(run_summary(run_dir), peak_mem_mb=round(peak_kb / 1024, 1))
    return atomic_write_json(run_dir / RESULT_FILE, result)
