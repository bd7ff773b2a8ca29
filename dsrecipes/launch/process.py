"""Running a launch plan's commands on this machine: subprocesses (with signal forwarding, and a stop once a rank
reported a failed node) or in-process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import dsrecipes.heartbeat as heartbeat
from dsrecipes.launch.plan import RANK_ENV, Command

FAILED_NODE_GRACE_S = 5  # after a rank reported a lost node: time for the launcher to stop the others itself


def child_env(extra: Mapping[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update(extra)
    return env


def run_subprocess(cmd: Command, run_dir: Path, log: Optional[Path] = None) -> int:
    """Run `cmd` and supervise it (`supervise`); with `log`, its output passes through `console.relay`
    (third-party noise goes to `log`)."""
    proc, relays = _start(cmd, log)
    # Pass a SIGTERM (scheduler, timeout) on to the launcher, which stops its ranks; no orphaned ranks.
    forward = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate()) if forward else None
    try:
        return supervise(proc, run_dir)
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        if forward:
            signal.signal(signal.SIGTERM, previous)
        for thread in relays:
            thread.join(timeout=10)  # a rank that outlives its launcher must not hold us here


def _start(cmd: Command, log: Optional[Path]) -> Tuple[subprocess.Popen, List[threading.Thread]]:
    """Start `cmd`: ranks learn the progress mode (and the terminal width for a bar drawn through a pipe)."""
    import shutil

    from dsrecipes.console import PROGRESS_ENV, progress_mode, relay

    columns = {"COLUMNS": str(shutil.get_terminal_size().columns)} if sys.stderr.isatty() else {}
    pipe = subprocess.PIPE if log is not None else None
    unbuffered = {"PYTHONUNBUFFERED": "1"} if pipe else {}  # ranks writing into a pipe would hold lines back
    env = child_env({PROGRESS_ENV: progress_mode(), **columns, **unbuffered, **cmd.env})
    proc = subprocess.Popen(cmd.argv, env=env, stdout=pipe, stderr=pipe)
    relays = [] if log is None else [relay(proc.stdout, sys.stdout, log), relay(proc.stderr, sys.stderr, log)]
    return proc, relays


def supervise(proc: subprocess.Popen, run_dir: Path) -> int:
    """Wait for the launcher. When a rank reports a lost node (<run>/failure.json, dsrecipes.heartbeat), say which
    node failed and give the launcher FAILED_NODE_GRACE_S to stop its ranks; then end its process tree (pdsh keeps
    waiting for ssh to a dead host, and deepspeed's own cleanup would ssh there too)."""
    deadline: Optional[float] = None
    while True:
        try:
            code = proc.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        if deadline is None and (run_dir / heartbeat.FAILURE_FILE).is_file():
            deadline = time.monotonic() + FAILED_NODE_GRACE_S
        elif deadline is not None and time.monotonic() > deadline:
            kill_tree(proc.pid)
            code = proc.wait()
            break
    failure = heartbeat.read_failure(run_dir) if code != 0 else None
    if failure is not None:
        print(f"error: {heartbeat.describe_failure(failure)}. The ranks on the other nodes were stopped; run the "
              "same command again to resume from the last checkpoint (trainer.resume=auto)", file=sys.stderr, flush=True)  # fmt: skip
    return code


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants. The tree is frozen (SIGSTOP) first, so nothing it starts meanwhile
    (deepspeed's cleanup spawns `pdsh ... pkill` on a SIGTERM, which would hang on a dead host) escapes."""
    import psutil

    frozen: Dict[int, "psutil.Process"] = {}
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for _ in range(10):
        try:
            found = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        new = [p for p in found if p.pid not in frozen]
        if not new:
            break
        for p in new:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.suspend()
            frozen[p.pid] = p
    for p in frozen.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    # Not the root: waiting on it would reap it here, and its Popen would then report exit code 0.
    psutil.wait_procs([p for p in frozen.values() if p.pid != pid], timeout=10)


def run_in_process(cmd: Command, run_dir: Path) -> int:
    import dsrecipes.worker as worker

    saved = {k: os.environ.get(k) for k in cmd.env}
    os.environ.update(cmd.env)
    try:
        result = worker.run(run_dir)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return result if isinstance(result, int) else 0


