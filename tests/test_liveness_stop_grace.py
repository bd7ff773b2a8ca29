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
