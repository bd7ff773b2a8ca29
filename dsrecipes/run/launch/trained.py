"""A launch that exits 0 is a success only when every rank reports that it trained the planned steps.

Every rank writes `<run>/rank_steps/rank<R>.json` (rank_records.write_rank_steps) as it finishes, before the last barrier,
so once any rank is past that barrier all reports exist. A launcher that ends with 0 while the plan said N > 0 steps
and some rank is missing or reports fewer (a launcher that ran something else, a worker that quit early without an
error) makes the run `failed` (exit 1, rank_outcome.json names why and the launcher command). A rank that stopped
early on purpose says why in its report (`ended_early`), and that is a success.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from dsrecipes.core.rank_records import read_rank_steps
from dsrecipes.core.runplan import PLAN_FILE, read_plan
from dsrecipes.run.launch.plan import Command

EXIT_CODE = 1


def untrained(run_dir: Path, commands: List[Command]) -> Optional[str]:
    """Why the ranks did not train what the plan said (None when they did, when the plan had nothing to do, or when
    there is no plan: `launch()` called on a bare directory, as unit tests do; a run always writes plan.json first)."""

    if not (Path(run_dir) / PLAN_FILE).is_file():
        return None
    plan = read_plan(run_dir)
    start = plan.resume.step if plan.resume is not None else 0
    if plan.total_steps <= start:
        return None
    reports = read_rank_steps(run_dir)
    missing = [r for r in range(plan.world_size) if r not in reports]
    short = [f"rank {r}: {reports[r]['step']}" for r in sorted(reports)
             if reports[r]["step"] < plan.total_steps and not reports[r].get("ended_early")]
    if not missing and not short:
        return None
    what = []
    if missing:
        what.append(f"no report of the steps it ran from rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))}")
    if short:
        what.append("fewer steps than planned (" + "; ".join(short) + ")")
    shown = " && ".join(c.shell() for c in commands)
    return (f"the launcher exited 0, but the plan said {plan.total_steps - start} optimizer steps "
            f"(up to step {plan.total_steps}) and the ranks did not train them: {' and '.join(what)}. A run that did not "
            f"train is not a success; see {run_dir}/logs/. Launcher command: {shown}")
