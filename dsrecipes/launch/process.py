"""Running a launch plan's commands on this machine: subprocesses (with signal forwarding) or in-process.

A launcher runs in a session of its own, so its whole tree (the deepspeed runner, its per-node `launch.py`, the
ranks and their DataLoader workers) is one process group. SIGTERM or SIGINT to the launching process is forwarded
to that group (deepspeed's single-node runner would otherwise die alone and leave the ranks training), the ranks get
`grace_s` to reach a step boundary and save (stopping.py), then whatever is left of the group is killed. After a
normal end, leftovers of the group are killed too: a run leaves no process behind.
"""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, Mapping, Optional

import dsrecipes.stopping as stopping
from dsrecipes.launch.plan import RANK_ENV, Command


def child_env(extra: Mapping[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update(extra)
    return env


def run_subprocess(cmd: Command, grace_s: float) -> int:
    """Run `cmd` in its own process group until it and everything it started have ended."""
    proc = subprocess.Popen(cmd.argv, env=child_env(cmd.env), start_new_session=True)
    stopped_at: Optional[float] = None

    def forward(signum: int) -> None:
        nonlocal stopped_at
        stopped_at = stopped_at or time.monotonic()
        _signal_group(proc.pid, signum)

    try:
        with stopping.handling(on_signal=forward, announce=True):
            while proc.poll() is None or (stopped_at is not None and _group_alive(proc.pid)):
                if stopped_at is not None and time.monotonic() - stopped_at > grace_s:
                    break  # out of time: the rest is killed below
                time.sleep(0.2)
    except KeyboardInterrupt:  # Ctrl-C twice
        _signal_group(proc.pid, signal.SIGKILL)
        raise
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # whatever is still there (leftover workers, a stuck rank)
        code = proc.wait()
    return code


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def run_in_process(cmd: Command, run_dir: Path, grace_s: float) -> int:
    """launcher=local: the rank runs here. A stop signal is acted on by the rank itself (stopping.py); if it has not
    stopped `grace_s` after the signal, it is interrupted where it stands."""
    import dsrecipes.worker as worker

    timers = []

    def deadline(signum: int) -> None:
        if not timers:
            timers.append(threading.Timer(grace_s, _thread.interrupt_main))
            timers[0].daemon = True
            timers[0].start()

    saved = {k: os.environ.get(k) for k in cmd.env}
    os.environ.update(cmd.env)
    try:
        with stopping.handling(on_signal=deadline, announce=True):
            result = worker.run_rank(run_dir)
    finally:
        for timer in timers:
            timer.cancel()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return result


