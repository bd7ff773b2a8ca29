"""A rank's wait for the run directory's rank lock is bounded (core/locks.py SharedLock): a launching process's probe
holds it exclusively for an instant, so a process that keeps holding it is said on the console while the rank
waits, and after locks.SHARED_WAIT_S the rank fails with one message naming the lock file and the holder. Before,
the rank blocked in flock(LOCK_SH) forever, silent, and its peers waited for it in the rendezvous."""

from __future__ import annotations

import subprocess
import sys
import threading

import dsrecipes.core.locks as locks
from dsrecipes.core.errors import UserError
from dsrecipes.core.rundir import RANKS_LOCK_FILE, rank_lock
from tests.fault_cases import outcome_within

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
sys.stdout.write("held\\n"); sys.stdout.flush()
time.sleep(60)
"""


def test_a_rank_lock_held_by_another_process_fails_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(locks, "SHARED_WAIT_S", 1.0, raising=False)  # (absent before: no bound)
    monkeypatch.setattr(locks, "WAIT_NOTE_S", 0.2, raising=False)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / RANKS_LOCK_FILE)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        outcome, took = outcome_within(lambda: rank_lock(tmp_path), 10)  # (old code: still blocked here)
    finally:
        holder.kill()
        holder.wait()
    assert took < 3, took
    assert isinstance(outcome, UserError), outcome
    message = str(outcome)
    assert str(tmp_path / RANKS_LOCK_FILE) in message and str(holder.pid) in message and "for 1 s" in message
    waiting = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dsrecipes: waiting for")]
    assert len(waiting) == 1 and str(holder.pid) in waiting[0] and "up to 1 s" in waiting[0]


def test_a_probe_that_lets_go_is_waited_for(tmp_path, monkeypatch):
    """The instant a launching process probes (exclusive, then released) is still waited out, not refused."""
    path = tmp_path / RANKS_LOCK_FILE
    monkeypatch.setattr(locks, "SHARED_WAIT_S", 5.0, raising=False)  # (absent before: no bound)
    probe = locks.ExclusiveLock(path).acquire()
    threading.Timer(0.3, probe.release).start()
    lock = rank_lock(tmp_path)
    assert lock.fd is not None and locks.probe_free(path) is not None
    lock.release()
    assert locks.probe_free(path) is None
