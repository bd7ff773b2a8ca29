"""Running a launch plan's commands on this machine: subprocesses (with signal forwarding) or in-process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from dsrecipes.launch.plan import RANK_ENV, Command


def child_env(extra: Mapping[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update(extra)
    return env


def run_subprocess(cmd: Command, log: Optional[Path] = None) -> int:
    """Run `cmd`; with `log`, its output passes through `console.relay` (third-party noise goes to `log`)."""
    proc, relays = _start(cmd, log)
    # Pass a SIGTERM (scheduler, timeout) on to the launcher, which stops its ranks; no orphaned ranks.
    forward = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate()) if forward else None
    try:
        return proc.wait()
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


