"""After a stop signal the launching process waits trainer.stop_grace_s for the ranks to save: a line while it waits
and, when a rank does not stop in time, one message naming it before the group is killed (was: silence, then only
'interrupted by SIGTERM')."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

import dsrecipes.run.launch.process as process

DEAF_RANK = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def test_a_rank_that_does_not_stop_in_the_grace_is_named_and_killed(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(process, "STOP_NOTE_S", 0.4)
    env = {**os.environ, "RANK": "1"}
    proc = subprocess.Popen([sys.executable, "-c", DEAF_RANK], env=env, start_new_session=True)
    stop = process._Stop(1.2)
    stop.at = time.monotonic()
    try:
        process.supervise(proc, tmp_path, stop)
    finally:
        process._end_group(proc.pid)
        proc.wait()
    err = capsys.readouterr().err
    assert f"waiting 0 s for rank 1 (pid {proc.pid}) to save and stop" in err or \
        f"for rank 1 (pid {proc.pid}) to save and stop (killed at trainer.stop_grace_s=1.2)" in err, err
    assert f"error: rank 1 (pid {proc.pid}) did not stop within trainer.stop_grace_s=1.2 s" in err, err
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


def test_a_local_rank_blocked_in_a_system_call_is_stopped_at_the_grace(tmp_path: Path, monkeypatch, capsys):
    """launcher=local: the grace's interrupt must reach a main thread blocked in a system call (a pipe read from a
    frozen DataLoader worker). Was: `_thread.interrupt_main` only flagged it, and the run waited for the stall
    watchdog (launcher.stall_timeout_s, 30 minutes) after a SIGTERM with trainer.stop_grace_s=5."""
    import signal
    import threading
    import types

    import pytest

    import dsrecipes.core.stopping as stopping

    r, w = os.pipe()
    fake = types.ModuleType("dsrecipes_test_blocked_rank")
    fake.run_rank = lambda run_dir: os.read(r, 1) and 0
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(process, "WORKER_MODULE", fake.__name__)
    monkeypatch.setattr(process, "_in_sweep", lambda: False)
    stopping.reset()
    term = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    release = threading.Timer(8, os.write, (w, b"x"))  # the old code: let the read end, late
    term.start()
    release.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            process.run_in_process(types.SimpleNamespace(env={}), tmp_path, 1.0)
        took = time.monotonic() - started
    finally:
        release.cancel()
        stopping.reset()
        os.close(r)
        os.close(w)
    assert took < 5, took
    assert "did not stop within trainer.stop_grace_s=1 s of the stop signal" in capsys.readouterr().err
