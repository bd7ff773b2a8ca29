"""What the ranks report to the launching process about how they ended, in the run directory (core/rundir.py):

    rank_outcome.json        rank 0: ok, interrupted at a step, failed with why (commands/outcome.py folds it into
                             result.json)
    rank_steps/rank<R>.json  each rank's own count of the steps it ran, written as it finishes (launch/trained.py)

A previous attempt's reports are cleared before a run starts (`clear_outcome`, only the names the ranks write); a
report that is unreadable or not of our shape counts as no report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from dsrecipes.core.fileio import atomic_write_json

OUTCOME_FILE = "rank_outcome.json"
STEPS_DIR = "rank_steps"


def write_outcome(run_dir: Path, outcome: Dict[str, Any]) -> Path:
    """Rank 0: how the ranks ended (`status`, `step`, `error`, ...); the launching process folds it into result.json."""
    return atomic_write_json(Path(run_dir) / OUTCOME_FILE, outcome)


def read_outcome(run_dir: Path) -> Optional[Dict[str, Any]]:
    try:
        outcome = json.loads((Path(run_dir) / OUTCOME_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return outcome if isinstance(outcome, dict) else None


def clear_outcome(run_dir: Path) -> None:
    """A previous attempt's rank reports (in a directory we own; only the files the ranks write)."""
    (Path(run_dir) / OUTCOME_FILE).unlink(missing_ok=True)
    for path in (Path(run_dir) / STEPS_DIR).glob("rank*.json"):
        if path.stem[4:].isdigit():
            path.unlink(missing_ok=True)


def write_rank_steps(run_dir: Path, rank: int, step: int, total: int, ended_early: Optional[str] = None) -> Path:
    """Every rank, once it trained to its end: the optimizer steps it has done (`ended_early`: why a run that stops
    before the planned total, e.g. early stopping, is still a success)."""
    (Path(run_dir) / STEPS_DIR).mkdir(exist_ok=True)
    report = {"rank": int(rank), "step": int(step), "planned": int(total), "ended_early": ended_early}
    return atomic_write_json(Path(run_dir) / STEPS_DIR / f"rank{int(rank)}.json", report)


def read_rank_steps(run_dir: Path) -> Dict[int, Dict[str, Any]]:
    """rank -> its report (unreadable or foreign files are left out: such a rank did not report)."""
    reports = {}
    for path in sorted((Path(run_dir) / STEPS_DIR).glob("rank*.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and path.stem == f"rank{report.get('rank')}" and isinstance(report.get("step"), int):
            reports[int(report["rank"])] = report
    return reports
