"""How a run ends: result.json from the launcher's exit code and the ranks' outcome; an interrupted run's newest
checkpoint and the exact command that continues it (printed and recorded)."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Sequence, Tuple

from dsrecipes.boundary.checkpoint_find import committed
from dsrecipes.core import stopping
from dsrecipes.core.failure import rank_failure
from dsrecipes.core.heartbeat import describe_failure, read_failure
from dsrecipes.core.rank_records import read_outcome
from dsrecipes.core.rundir import CHECKPOINTS_DIR, write_result


def conclude(run_dir: Path, code: int, dry_run: bool, argv: Sequence[str]) -> Tuple[int, bool]:
    """Write result.json for a launch that returned `code`; returns (exit code, interrupted)."""
    outcome = read_outcome(run_dir) or {}
    extra = {k: v for k, v in outcome.items() if k not in ("status", "error", "signal")}
    signum = stopping.requested() or outcome.get("signal")
    if outcome.get("status") == "ok":  # the ranks finished (a signal that came during the last step changes nothing)
        code = 0
    if signum is not None and code != 0:
        return report_interrupted(run_dir, int(signum), extra, argv), True
    if code != 0:
        code, killed_by = launcher_code(code)
        error = report_failed(run_dir, argv) or outcome.get("error")
        if killed_by is not None:
            killed = f"a rank was killed by {killed_by}"
            print(f"error: {killed}", file=sys.stderr, flush=True)
            error, extra = (f"{error} ({killed})" if error else killed), {**extra, "rank_signal": killed_by}
        write_result(run_dir, code, error or f"ranks exited with code {code}", **extra)
    else:
        write_result(run_dir, 0, None, "dry_run" if dry_run else "ok", **extra)
    return code, False


# Signals that kill a rank outright (the OOM killer, a crash): the launchers pass the rank's return code -N on,
# which the shell sees as 256 - N (DeepSpeed's launcher: sys.exit(-9) is exit status 247).
KILLING_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)


def launcher_code(code: int) -> Tuple[int, str | None]:
    """The run's exit code for a failed launch and, when a rank was killed by a signal, its name: -9 or 247 (a rank
    killed by SIGKILL) is exit 1 with 'SIGKILL', never the launcher's wrapped-around number."""
    for signum in KILLING_SIGNALS:
        if code in (-signum, 256 - signum):
            return 1, signum.name
    return (code if code > 0 else 1), None


def report_failed(run_dir: Path, argv: Sequence[str]) -> str | None:
    """The first failing rank's one-line cause (core/failure.py), printed with where its traceback is and, when a
    checkpoint exists, the command that resumes from it; None when no rank reported one."""
    report = rank_failure(run_dir)
    if report is None:  # a lost node or rank (core/heartbeat.py): the launcher printed it; result.json says it too
        lost = read_failure(run_dir)
        return describe_failure(lost) if lost is not None else None
    if report.get("render"):  # a user error found by a rank: its own message, as any other (no traceback kept)
        lines = [str(report["render"])]
    else:
        lines = [f"error: {report['reason']}"] + ([f"  full traceback: {report['log']}"] if report.get("log") else [])
    newest = committed(run_dir / CHECKPOINTS_DIR)
    if newest and report.get("resumable", True):
        lines.append(f"  resume from {newest[0]} with:\n  {resume_command(run_dir, argv, keep_resume_from=False)}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return str(report["render"] or report["reason"])


def report_interrupted(run_dir: Path, signum: int, extra: dict, argv: Sequence[str]) -> int:
    """Write result.json `interrupted`, print where it stopped and how to resume; returns the exit code."""

    newest = committed(run_dir / CHECKPOINTS_DIR)
    checkpoint = str(newest[0]) if newest else None
    command = resume_command(run_dir, argv, keep_resume_from=not newest)
    code = stopping.exit_code(signum)
    name = signal.Signals(signum).name
    print(f"\n{interrupted_message(name, checkpoint, stopping.forced())}. Resume with:\n  {command}", file=sys.stderr,
          flush=True)
    extra = {**extra, "checkpoint": checkpoint, "resume_command": command}
    write_result(run_dir, code, f"interrupted by {name}", "interrupted", **extra)
    return code


def interrupted_message(signal_name: str, checkpoint: str | None, at_once: str | None) -> str:
    """How it stopped (`at_once`: how it was stopped at once, stopping.forced()) and what the resume command
    continues from: the latest checkpoint, or step 1."""
    how = at_once or f"interrupted by {signal_name}"
    if checkpoint is None:
        return f"{how} (no checkpoint yet: the command below starts from step 1)"
    return f"{how} (latest checkpoint: {checkpoint})"


def resume_command(run_dir: Path, argv: Sequence[str], keep_resume_from: bool) -> str:
    """This invocation again, into the same run directory with trainer.resume=auto (from the same directory; a
    run that saved nothing yet keeps its trainer.resume_from)."""
    drop = {"trainer.output_dir", "hydra.run.dir", "trainer.resume"}
    if not keep_resume_from:
        drop.add("trainer.resume_from")
    kept = [ov for ov in argv if ov.split("=", 1)[0].lstrip("+~") not in drop]
    args = [sys.executable, "-m", "dsrecipes", *kept, f"trainer.output_dir={run_dir}"]
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join(args)}"
