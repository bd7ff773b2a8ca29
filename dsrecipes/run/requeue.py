"""`python -m dsrecipes.run.requeue --run-dir RUN`: the first step of a requeued `launcher=slurm` batch
job (an entry point of its own, like worker.py). It sits at the top level, not in launch/: it imports entry.py,
which imports launch/, and a module in launch/ importing entry.py would tie the two folders both ways.

The job's ranks only read the run directory, and refuse a plan.json older than the run's newest checkpoint
(train.check_plan_current). A requeued job therefore plans its continuation first, on the batch host: the config
the run was started with, `trainer.resume=auto`, the newest verified checkpoint (launch/slurm.py writes the call).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import List, Optional

from dsrecipes.config.load import load_run_config
from dsrecipes.core.errors import UserError
from dsrecipes.core.rundir import CHECKPOINTS_DIR, claim
from dsrecipes.core.runplan import RunPlan
from dsrecipes.core.schema import ResumeMode
from dsrecipes.core.topology import resolve_topology
from dsrecipes.core.typed import config_to_dict
from dsrecipes.run.resume_contract import identity_fingerprint


def replan(run_dir: Path) -> RunPlan:
    """Plan the continuation of the run in `run_dir` from its newest verified checkpoint, with the config it was
    started with (holding the run directory's lock meanwhile); returns the new plan."""
    from dsrecipes.boundary.checkpoint_find import committed  # lazy: else `requeue` imports torch 3.80 s, numpy 0.11 s
    from dsrecipes.run.entry import describe_plan, write_run_dir  # lazy: else `requeue` imports numpy 0.11 s

    run_dir = Path(run_dir).resolve()
    cfg = load_run_config(run_dir)
    # Its own checkpoints first; a run that has committed none yet continues from where it started.
    keep_from = cfg.trainer.resume_from if not committed(run_dir / CHECKPOINTS_DIR) else None
    trainer = dataclasses.replace(cfg.trainer, resume=ResumeMode.auto, resume_from=keep_from, output_dir=str(run_dir))
    cfg = dataclasses.replace(cfg, trainer=trainer)
    with claim(run_dir, "--run-dir", identity_fingerprint(config_to_dict(cfg))):
        plan = write_run_dir(cfg, resolve_topology(cfg.launcher))
    print(f"run directory: {run_dir}  ({describe_plan(plan)})", flush=True)
    return plan


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsrecipes.run.requeue", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="the run directory of the requeued job")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        replan(Path(args.run_dir))
    except UserError as exc:
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
