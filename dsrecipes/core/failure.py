"""How a failing rank is reported: one line naming the cause (never a traceback on the console: the full one goes
to the rank's log), recorded in `<run>/failure.json` by the first rank that fails (`write_failure`: the first report
wins, later ones come from ranks that saw the run coming down; core/heartbeat.py records a lost or stalled rank there
too, `describe_failure` says it). The launching process prints that line, where the log is and the resume command
(commands/outcome.py), and result.json holds the same line.

Torch-free: the launching side reads what the ranks wrote.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import dsrecipes.core.stall as stall
from dsrecipes.core.errors import Refused, UserError

FAILURE_FILE = "failure.json"
MAX_CAUSE = 400  # characters of the one-line cause
PEER_DEATH_WAIT_S = 2.0  # after a broken pipe to a child: how long its death may take to become visible
# Signals that kill a rank outright (the OOM killer, a crash): the launchers pass the rank's return code -N on,
# which the shell sees as 256 - N (DeepSpeed's per-node launcher: sys.exit(-9) is exit status 247).
KILLING_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)
_WORKER = re.compile(r"^Caught (\w+) in DataLoader worker process (\d+)\.")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)')


def one_line(exc: BaseException) -> str:
    """The cause of `exc` in one line: a user error's own message; otherwise 'Type: message (at file:line)', with
    an exception that torch re-raised from a DataLoader worker unwrapped ('... in DataLoader worker N')."""
    text = str(exc)
    worker = _WORKER.match(text)
    if worker is not None:
        name, message, where = _unwrap(text)
        if isinstance(exc, UserError):
            return _short(message)
        return _short(f"{name or worker.group(1)} in DataLoader worker {worker.group(2)}: {message}{where}")
    if isinstance(exc, UserError):
        return _short(" ".join(p.strip() for p in exc.problems))
    if getattr(exc, "plain", False):  # its message says it all (e.g. a DataLoader worker killed by a signal)
        return _short(text)
    return _short(f"{type(exc).__name__}: {text.strip() or '(no message)'}{_where(exc.__traceback__)}")


def unwrapped(exc: BaseException) -> BaseException:
    """A user error that torch re-raised from a DataLoader worker (its message: 'Caught DataError in DataLoader
    worker process N. Original Traceback ...') as the error the worker raised: one message, no traceback text."""
    if not isinstance(exc, UserError) or _WORKER.match(str(exc)) is None:
        return exc
    try:
        return type(exc)(_unwrap(str(exc))[1])
    except Exception:  # noqa: BLE001 - a subclass with another signature: a plain UserError says the same
        return UserError(_unwrap(str(exc))[1])


def _unwrap(text: str) -> Tuple[str, str, str]:
    """(type name, message, ' (at file:line)') of the original exception in torch's re-raised text."""
    lines = text.rstrip("\n").splitlines()
    last_frame = max((i for i, line in enumerate(lines) if _FRAME.match(line)), default=-1)
    where = ""
    if last_frame >= 0:
        m = _FRAME.match(lines[last_frame])
        where = f" (at {_relative(m.group(1))}:{m.group(2)})" if m else ""
    rest = [line for line in lines[last_frame + 1:] if line.strip() and not line.startswith("    ")]
    head = " ".join(rest) or lines[0]
    name, _, message = head.partition(": ")
    return name.rsplit(".", 1)[-1], message.strip() or head, where


def _where(tb: Any) -> str:
    """' (at file:line)' of the innermost frame of a traceback (None: nothing)."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    return f" (at {_relative(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


def _relative(path: str) -> str:
    """Our own files relative to the package's parent (dsrecipes/...); others as they are."""
    root = str(Path(__file__).resolve().parents[2]) + os.sep
    return path[len(root):] if path.startswith(root) else path


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_CAUSE else text[:MAX_CAUSE - 3] + "..."


def record_rank_failure(run_dir: Path, rank: int, exc: BaseException, log: Optional[Path]) -> Dict[str, Any]:
    """Record this rank's failure unless another rank did first; returns the report that stands. A user error
    (bad data, a refused checkpoint) keeps its own message (`render`), printed as the launching process would."""
    cause = one_line(exc)
    exc = unwrapped(exc)
    render = exc.render() if isinstance(exc, UserError) else None
    report = {"rank": int(rank), "cause": cause, "reason": render[len("error: "):] if render else
              f"rank {rank} failed: {cause}", "render": render, "log": str(log) if log else None,
              "pid": os.getpid(), "time": time.time(), "resumable": not isinstance(exc, Refused)}
    try:
        return write_failure(Path(run_dir), report)
    except OSError as exc:  # an unwritable run directory (a full disk): nobody can read it there, so the rank
        return dict(report, unrecorded=f"{type(exc).__name__}: {exc}",  # says it itself (rank/worker.failed)
                    disk_full=exc.errno in (errno.ENOSPC, errno.EDQUOT))


def rank_failure(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The first failing rank's report (None: no rank reported a failure of its own, e.g. a lost node)."""
    report = read_failure(run_dir)
    if report is None or not isinstance(report.get("cause"), str):
        return None
    return report


def log_traceback(log: Optional[Path], exc: BaseException) -> None:
    """Append the full traceback of `exc` to the rank's log (the console gets one line)."""
    if log is None:
        return
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a", encoding="utf-8") as fh:
            fh.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    except OSError:
        pass


TRACEBACK_ENV = "DSRECIPES_TRACEBACK"  # =1: a crash of the launching process shows its traceback on the console


def crash_line(exc: BaseException, log: Path) -> str:
    """A crash of the launching process (an exception that is no refusal: a bug here or in a library) as the one
    line the console gets; its traceback is appended to `log` (the run's logs/main.log, else a file of its own)."""
    log_traceback(log, exc)
    return (f"{one_line(exc)}: an unexpected error (a bug in dsrecipes or in a library it called); its traceback is in "
            f"{log} ({TRACEBACK_ENV}=1 prints it here)")


def from_a_dead_peer(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is what a process sees when the process at the other end
    of a pipe or socket died: a connection reset, a broken pipe, an EOF, or torch's 'DataLoader worker (pid ...)
    exited unexpectedly / is killed by signal'."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, EOFError)) or "DataLoader worker (pid" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def died_by_signal(procs: Iterable[Any], wait_s: float) -> Optional[Tuple[int, int, int]]:
    """(index, pid, signal number) of the first of `procs` (multiprocessing processes) that died of a signal,
    polling for up to `wait_s` seconds (0: look once). The wait covers a race the kernel leaves open: a process
    killed by SIGKILL closes its pipes before it becomes a zombie, so its peer may read the broken pipe before
    `exitcode` can tell why."""
    procs = list(procs)
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        for index, proc in enumerate(procs):
            try:
                code = proc.exitcode  # (waitpid WNOHANG on a child)
            except Exception:  # noqa: BLE001 - a process object of another kind, or already closed
                continue
            if code is not None and code < 0:
                return index, int(proc.pid), -int(code)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def write_failure(run_dir: Path, record: Dict[str, Any], unwritable_ok: bool = False) -> Dict[str, Any]:
    """Write <run>/failure.json unless a rank did first; returns the report that stands. The first one wins: later
    ones come from ranks that saw the run coming down (their own node's ranks stopping included), not the cause.
    `unwritable_ok` (a heartbeat's thread, which ends its rank anyway): a write that fails returns `record` itself
    (a full disk: nobody could read it there, and the rank's own failure says it, rank/worker.failed)."""
    tmp = run_dir / f".{FAILURE_FILE}.{os.getpid()}.tmp"
    try:  # a full disk fails the write: raised, and nothing of it is left behind
        try:
            tmp.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        except OSError:
            if unwritable_ok:
                return record
            raise
        try:
            os.link(tmp, run_dir / FAILURE_FILE)  # atomic, and fails if another rank reported first
        except OSError:
            return read_failure(run_dir) or record
    finally:
        tmp.unlink(missing_ok=True)
    return record


def read_failure(run_dir: Path) -> Optional[Dict[str, Any]]:
    try:
        return json.loads((Path(run_dir) / FAILURE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def describe_failure(record: Dict[str, Any]) -> str:
    """'node 1 (node1, 10.213.0.2) failed: ranks 2, 3 stopped responding (no heartbeat for 10 s)', or for a stall
    'the run stalled: rank 1 (node 0, host h) at step 12, phase data (next batch) for 1800 s (no step progress ...)'."""
    if record.get("stalled"):
        return f"the run stalled: {stall.describe(record['stalled'])} ({record.get('reason', 'no step progress')})"
    by_node: Dict[str, List[int]] = {}
    for who in record.get("lost", []):
        where = [str(x) for x in (who.get("host"), who.get("addr")) if x]
        node = f"node {who['node']}" if who.get("node") is not None else "node"
        label = f"{node} ({', '.join(where)})" if where else node
        by_node.setdefault(label, []).append(int(who["rank"]))
    parts = [f"{label} failed: rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} stopped responding"
             for label, r in by_node.items()]  # fmt: skip
    if not parts:
        return str(record.get("reason", "a peer failed"))
    return "; ".join(parts) + f" ({record.get('reason', 'unknown')})"


def killed_by(code: Optional[int]) -> Optional[str]:
    """The name of the signal that killed a rank when a launcher's exit code says so (-9 or 247: 'SIGKILL'), else
    None."""
    for signum in KILLING_SIGNALS:
        if code in (-signum, 256 - signum):
            return signum.name
    return None
