"""Launchers: turn the run directory the launching process wrote into running ranks.

`build_plan` asks the builder table (`builders.BUILDERS`, one per `LauncherKind`) for the commands, support files
and requirements; `launch` writes the files and `<run>/launch.txt`, checks the tools, and runs the commands meant
for this machine (or only prints them with `launcher.dry_run=true`). Every rank runs
`python -m dsrecipes.rank.worker --run-dir RUN` and reads only that directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Mapping, Optional

from dsrecipes.core.console import log_path
from dsrecipes.core.distributed import remove_shm_buffers
from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import atomic_write_text
from dsrecipes.core.heartbeat import FAILURE_FILE
from dsrecipes.core.rank_records import write_outcome
from dsrecipes.core.schema import LauncherKind, TrainConfig
from dsrecipes.run.launch.builders import BUILDERS, resolve_master_port
from dsrecipes.run.launch.plan import LAUNCH_FILE, WORKER_MODULE, Command, LaunchPlan, render_plan
from dsrecipes.run.launch.process import run_in_process, run_subprocess
from dsrecipes.run.launch.trained import EXIT_CODE, untrained

__all__ = ["build_plan", "build_commands", "launch", "render_plan", "resolve_master_port", "Command", "LaunchPlan"]


def build_plan(
    cfg: TrainConfig,
    run_dir: Path,
    *,
    master_port: Optional[int] = None,
    worker_module: str = WORKER_MODULE,
    environ: Optional[Mapping[str, str]] = None,
) -> LaunchPlan:
    """The commands, support files and requirements for `cfg.launcher.kind` (pure but for the port choice)."""
    port = resolve_master_port(cfg) if master_port is None else master_port
    env = os.environ if environ is None else environ
    return BUILDERS[cfg.launcher.kind](cfg, Path(run_dir).resolve(), port, worker_module, env)


def build_commands(cfg: TrainConfig, run_dir: Path, **kwargs) -> List[Command]:
    return build_plan(cfg, run_dir, **kwargs).commands


def launch(cfg: TrainConfig, run_dir: Path, *, worker_module: str = WORKER_MODULE) -> int:
    """Start the ranks for `cfg` (or print them with launcher.dry_run); returns the exit code of this node's ranks.

    Writes the plan's support files and `<run>/launch.txt`. A missing tool (mpirun, mpi4py, sbatch, ...) raises
    UserError (exit 2) before anything starts.
    """
    run_dir = Path(run_dir).resolve()
    port = resolve_master_port(cfg)
    plan = build_plan(cfg, run_dir, master_port=port, worker_module=worker_module)
    for name, content in plan.files.items():
        atomic_write_text(run_dir / name, content)
    text = render_plan(cfg.launcher.kind.value, plan)
    atomic_write_text(run_dir / LAUNCH_FILE, text)
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if cfg.launcher.dry_run:
        print(text, end="")
        return 0
    missing = [
        f"launcher.kind={cfg.launcher.kind.value}: {r.name} not found ({r.why})" for r in plan.requires if r.missing()
    ]
    if missing:
        raise UserError(missing)
    mine = [c for c in plan.commands if c.node_rank is None or c.node_rank == cfg.launcher.node_rank]
    (run_dir / FAILURE_FILE).unlink(missing_ok=True)  # a previous attempt's report (ranks write it)
    grace = cfg.trainer.stop_grace_s
    try:
        for cmd in mine:
            if cmd.in_process:
                code = run_in_process(cmd, run_dir, grace)
            else:
                code = run_subprocess(cmd, run_dir, grace, log_path(run_dir, "launcher"))
            if code != 0:
                return code
    finally:
        remove_shm_buffers(port)  # this machine's ranks have ended: their shared-memory segments go too
    return _trained(cfg, run_dir, mine, worker_module)


def _trained(cfg: TrainConfig, run_dir: Path, commands: List[Command], worker_module: str) -> int:
    """0 when the ranks report the planned steps (launch/trained.py); else the reason goes to rank_outcome.json
    (the run's result.json then says `failed`) and the exit code is 1. SLURM returns at submission: the job's ranks
    have not run yet. Another worker module (tests' probes) reports nothing."""

    if cfg.launcher.kind is LauncherKind.slurm or worker_module != WORKER_MODULE:
        return 0
    why = untrained(run_dir, commands)
    if why is None:
        return 0
    print(f"error: {why}", file=sys.stderr, flush=True)
    write_outcome(run_dir, {"status": "failed", "error": why})
    return EXIT_CODE
