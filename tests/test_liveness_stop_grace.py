"""After a stop signal the launching process waits trainer.stop_grace_s for the ranks to save: a line while it waits
and, when a rank does not stop in time, one message naming it before the group is killed (was: silence, then only
'interrupted by SIGTERM')."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import psutil
import pytest

import dsrecipes.core.stopping as stopping
import dsrecipes.run.launch.process as process
from dsrecipes.run.launch.tree import end_group

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
        end_group(proc.pid)
        proc.wait()
    err = capsys.readouterr().err
    assert f"waiting 0 s for rank 1 (pid {proc.pid}) to save and stop" in err or \
        f"for rank 1 (pid {proc.pid}) to save and stop (killed at trainer.stop_grace_s=1.2)" in err, err
    assert f"error: rank 1 (pid {proc.pid}) did not stop within trainer.stop_grace_s=1.2 s" in err, err
    assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("grace_s", [1.0, 0.3])
def test_a_local_rank_blocked_in_a_system_call_is_stopped_at_the_grace(tmp_path: Path, monkeypatch, capsys, grace_s):
    """launcher=local: the grace's interrupt must reach a main thread blocked in a system call (a pipe read from a
    frozen DataLoader worker). Was: `_thread.interrupt_main` only flagged it, and the run waited for the stall
    watchdog (launcher.stall_timeout_s, 30 minutes) after a SIGTERM with trainer.stop_grace_s=5.

    The run then ends as the SIGTERM's interruption (exit 143, as a SIGTERM stop that kept its step), saying the rank
    was stopped at the grace. Was: "stopped at once by a second SIGINT", exit 130, and a grace under a second
    (stopping.SAME_INTERRUPTION_S) was ignored as a copy of the SIGTERM: the rank was not stopped at all."""
    from dsrecipes.commands.outcome import report_interrupted

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
        with pytest.raises(KeyboardInterrupt) as stopped:
            process.run_in_process(types.SimpleNamespace(env={}), tmp_path, grace_s)
        took = time.monotonic() - started
        code = report_interrupted(tmp_path, stopping.signal_of(stopped.value), {}, ["debug=fast"])
    finally:
        release.cancel()
        stopping.reset()
        os.close(r)
        os.close(w)
    assert took < 5, took
    err = capsys.readouterr().err
    assert f"did not stop within trainer.stop_grace_s={grace_s:g} s of the stop signal" in err, err
    assert code == 143, err
    assert (f"interrupted by SIGTERM; the rank did not stop within trainer.stop_grace_s={grace_s:g} s and was "
            "stopped where it stood (no checkpoint yet") in err, err
    assert "second SIGINT" not in err, err
    assert json.loads((tmp_path / "result.json").read_text())["error"] == "interrupted by SIGTERM"
