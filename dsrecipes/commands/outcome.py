"""How a run ends: result.json from the launcher's exit code and the ranks' outcome; an interrupted run's newest
checkpoint and the exact command that continues it (printed and recorded)."""

from __future__ import annotations

import errno
import os
import shlex
import signal
import sys
import tempfile
from contextvars import ContextVar
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from dsrecipes.boundary.checkpoint_find import committed, trust_to_repeat
from dsrecipes.core import stopping
from dsrecipes.core.console import LOGS_DIR
from dsrecipes.core.failure import killed_by, rank_failure
from dsrecipes.core.heartbeat import describe_failure, read_failure
from dsrecipes.core.rank_records import read_outcome
from dsrecipes.core.rundir import CHECKPOINTS_DIR, write_result
from dsrecipes.run.launch.process import killed_alone, launcher_hung, stopped_code

# The command that resumes more than this run (a pipeline's, set around each stage: commands/pipeline.py): the run
# then prints no resume command of its own (its caller prints that one, once) and records that one in result.json.
RESUMED_BY: ContextVar[Optional[str]] = ContextVar("RESUMED_BY", default=None)
# Where a failed run's cause goes instead of the console while a caller says it once, with more (a pipeline's stage:
# commands/pipeline.train_stage names the stage and the pipeline's resume command with it); None: printed.
CAUSES: ContextVar[Optional[List[str]]] = ContextVar("CAUSES", default=None)


def conclude(run_dir: Path, code: int, dry_run: bool, argv: Sequence[str]) -> Tuple[int, bool]:
    """Write result.json for a launch that returned `code`; returns (exit code, interrupted)."""
    outcome = read_outcome(run_dir) or {}
    extra = {k: v for k, v in outcome.items() if k not in ("status", "error", "signal")}
    launcher = killed_alone(run_dir)  # (its ranks ended with it: no rank's signal, though the code is the launcher's)
    hung = launcher_hung(run_dir)  # (killed here after its ranks ended: its code says nothing of theirs)
    # (the launching process stopped the ranks with a SIGTERM of its own: their launcher was killed, stopping.cause)
    signum = stopping.requested() or outcome.get("signal") or (signal.SIGTERM if stopping.cause() else None)
    if outcome.get("status") == "ok":  # the ranks finished (a signal that came during the last step changes nothing)
        code = 0
    if signum is not None and code != 0:
        return report_interrupted(run_dir, int(signum), extra, argv), True
    if code != 0:
        signal_name = killed_by(code) if hung is None else None
        code = 1 if signal_name is not None or code < 0 else code  # never the launcher's wrapped-around 247
        code = stopped_code(run_dir) if hung is not None else code
        if signal_name is not None and rank_failure(run_dir) is None:
            error = report_killed(run_dir, signal_name, launcher)
        else:
            error = report_failed(run_dir, argv) or outcome.get("error")
            if error is None:
                return report_unexplained(run_dir, code, extra, hung), False
            error = f"{error} ({launcher or f'a rank was killed by {signal_name}'})" if signal_name else error
        extra = {**extra, "rank_signal": signal_name} if signal_name and launcher is None else extra
        write_result(run_dir, code, error, **extra)
    else:
        write_result(run_dir, 0, None, "dry_run" if dry_run else "ok", **extra)
    return code, False


def report_killed(run_dir: Path, signal_name: str, launcher: Optional[str] = None) -> str:
    """One line for ranks killed by a signal (the OOM killer, a crash), naming them where a peer saw them go (its
    heartbeat record, core/heartbeat.py): the launcher stopped the others; or, `launcher`, how their launcher was
    killed with no rank left to stop (run/launch/process.killed_alone). Printed, and returned for result.json."""
    message = launcher or _ranks_killed(run_dir, signal_name)
    newest = committed(run_dir / CHECKPOINTS_DIR)
    resume = "; run the same command again to resume from the last checkpoint (trainer.resume=auto)" if newest else ""
    say(f"error: {message}{resume}")
    return message


def _ranks_killed(run_dir: Path, signal_name: str) -> str:
    lost = (read_failure(run_dir) or {}).get("lost")
    lost = lost if isinstance(lost, list) else []
    lost = [w for w in lost if isinstance(w, dict) and isinstance(w.get("rank"), int)]
    ranks = sorted({w["rank"] for w in lost})
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "a rank"
    why = ("the kernel's OOM killer sends it when memory runs out: `dmesg` says whether it did"
           if signal_name == "SIGKILL" else f"a crash in native code: {run_dir / LOGS_DIR}/ has what it printed")
    where = "".join(f"; {place}" for place in map(_place, lost) if place)
    return (f"{who} {'were' if len(ranks) > 1 else 'was'} killed by {signal_name} ({why}){where}; the other ranks "
            "were stopped")  # fmt: skip


def _place(who: dict) -> str:
    """'rank 0 ran on host vm (local rank 0, pid 1234)' from a peer's heartbeat record of it (what it knew)."""
    known = ", ".join(f"{key.replace('_', ' ')} {who[key]}" for key in ("local_rank", "pid") if who.get(key) is not None)
    if not who.get("host"):
        return f"rank {who['rank']}: {known}" if known else ""
    return f"rank {who['rank']} ran on host {who['host']}" + (f" ({known})" if known else "")


def report_unexplained(run_dir: Path, code: int, extra: dict, hung: Optional[str] = None) -> int:
    """A failed launch that no rank explained (a launcher that could not start its ranks, a rank that exited without
    a report; `hung`: how their launcher, stuck after they ended, was killed, process.launcher_hung): said, so that
    the console never ends a failed run without an error line; written to result.json.
    On a disk without room for result.json, the rank could not record its failure either and said it itself
    (rank/worker.failed): nothing more is said or written. Returns the exit code."""
    if no_room(run_dir):
        return code
    message = f"{hung}; the ranks left no report of how they ended" if hung else \
        f"the ranks exited with code {code} without a report"
    say(f"error: {message}; what they printed is in {run_dir / LOGS_DIR}/")
    write_result(run_dir, code, message, **extra)
    return code


def no_room(run_dir: Path) -> bool:
    """Whether the disk of `run_dir` has no room for a small file (written unnamed, O_TMPFILE, and dropped)."""
    try:
        with tempfile.TemporaryFile(dir=run_dir) as fh:
            fh.write(b"\0" * 4096)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return False


def report_failed(run_dir: Path, argv: Sequence[str]) -> str | None:
    """The first failing rank's one-line cause (core/failure.py), printed with where its traceback is and, when a
    checkpoint exists, the command that resumes from it; None when no rank reported one."""
    report = rank_failure(run_dir)
    if report is None:  # a lost node or rank (core/heartbeat.py): the launcher printed it; result.json says it too
        lost = read_failure(run_dir)
        return describe_failure(lost) if lost is not None else None
    log = f"full traceback: {report['log']}" if report.get("log") and not report.get("render") else None
    if CAUSES.get() is not None:  # the caller says it, in one line
        say(str(report["render"] or f"error: {report['reason']}") + (f" ({log})" if log else ""))
        return str(report["render"] or report["reason"])
    # a user error found by a rank: its own message, as any other (no traceback kept)
    lines = [str(report["render"] or f"error: {report['reason']}")] + ([f"  {log}"] if log else [])
    newest = committed(run_dir / CHECKPOINTS_DIR)
    if newest and report.get("resumable", True) and RESUMED_BY.get() is None:
        lines.append(f"  resume from {newest[0]} with:\n  {resume_command(run_dir, argv, keep_resume_from=False)}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    return str(report["render"] or report["reason"])


def say(message: str) -> None:
    """A failed run's cause: printed, or kept for the caller that says it (CAUSES)."""
    causes = CAUSES.get()
    if causes is None:
        print(message, file=sys.stderr, flush=True)
    else:
        causes.append(message)


def report_interrupted(run_dir: Path, signum: int, extra: dict, argv: Sequence[str]) -> int:
    """Write result.json `interrupted`, print where it stopped and how to resume; returns the exit code."""

    newest = committed(run_dir / CHECKPOINTS_DIR)
    checkpoint = str(newest[0]) if newest else None
    command = RESUMED_BY.get() or resume_command(run_dir, argv, keep_resume_from=not newest)
    code = stopping.exit_code(signum)
    name = signal.Signals(signum).name
    why = stopped_why(extra.get("stopped_at_step"))
    said = interrupted_message(name, checkpoint, stopping.forced() or why)
    print(f"\n{said}" if RESUMED_BY.get() else f"\n{said}. Resume with:\n  {command}", file=sys.stderr, flush=True)
    extra = {**extra, "checkpoint": checkpoint, "resume_command": command}
    write_result(run_dir, code, why or f"interrupted by {name}", "interrupted", **extra)
    return code


def stopped_why(step: object) -> str | None:
    """Why this process stopped the ranks itself (stopping.cause: their launcher was killed) and at which step they
    stopped; None for a stop signal sent to this run."""
    why = stopping.cause()
    if why is None:
        return None
    return f"{why}; they were stopped at step {step}" if isinstance(step, int) else f"{why}; they were stopped"


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
    args = [sys.executable, "-m", "dsrecipes", *kept, f"trainer.output_dir={run_dir}",
            *trust_to_repeat(run_dir, keep_resume_from)]  # what this command trusted and that one loads again
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join(args)}"
