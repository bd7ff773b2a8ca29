"""Per-rank entry point: `python -m dsrecipes.rank.worker --run-dir RUN` (under deepspeed, torchrun, mpirun or srun).

Reads the run directory the launching process wrote (config.yaml + ds_config.json) and never re-composes Hydra,
so every rank trains exactly the resolved config. The local launcher calls `run(run_dir)` in-process instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

import dsrecipes.core.heartbeat as heartbeat
from dsrecipes.config.load import load_run_config
from dsrecipes.core.console import log_path, quiet_third_party, survive_lost_console
from dsrecipes.core.errors import RunInterrupted, TrainingFailed, UserError
from dsrecipes.core.schema import Device
from dsrecipes.rank.checkpoint import TrainState
from dsrecipes.rank.train import train


def run(run_dir: str | Path) -> TrainState:
    """Train the run in `run_dir` as the rank described by the environment (RANK, WORLD_SIZE, ...)."""

    cfg = load_run_config(run_dir)
    if cfg.trainer.device is Device.cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the first `import deepspeed`

    try:
        return train(cfg, run_dir)
    except UserError:
        raise
    except Exception:
        heartbeat.explain_crash()  # a broken collective because a node died: name the node (exits) or re-raise
        raise


def run_rank(run_dir: str | Path) -> int:
    """`run()`, as an exit code: 0 when it trained to the end, the signal's code (130/143) when it stopped on
    SIGINT/SIGTERM, 1 when training failed (non-finite loss; the ranks wrote why into rank_outcome.json)."""
    try:
        run(run_dir)
    except RunInterrupted as exc:
        return exc.exit_code
    except TrainingFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsrecipes.rank.worker", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory written by `python -m dsrecipes`")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    log = log_path(Path(args.run_dir), f"rank{os.environ.get('RANK', '0')}")
    quiet_third_party(log)  # before deepspeed loads
    survive_lost_console(log)
    try:
        return run_rank(args.run_dir)
    except UserError as exc:
        print(exc.render(), file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
