"""The fault-matrix harness (tests/fault_cases.py) finds its target whatever the process table looks like at that
moment: a rank's child that just ended (a zombie, an epoch's worker shutting down) is skipped instead of escaping as
psutil.ZombieProcess, a rank listed after its own DataLoader workers (pids wrap around) is still the rank, and a
worker that ended by itself before its SIGKILL is replaced by the next one found. No run is started: fake ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import fault_cases

# A "rank": forks a child that ends at once and is never reaped (a zombie with the rank's command line), then,
# 0.5 s later, a live child with its command line (a DataLoader worker).
RANK = """
import os, sys, time
if os.fork() == 0:
    os._exit(0)
time.sleep(0.5)
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
sys.stdout.write("ready\\n"); sys.stdout.flush()
time.sleep(60)
"""


@pytest.fixture
def fake_rank():
    proc = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, start_new_session=True)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_workers_of_skips_a_child_that_ended(fake_rank):
    """Before: the zombie's cmdline() raised psutil.ZombieProcess out of the 30 s loop."""
    time.sleep(0.2)  # the zombie exists, the live worker not yet
    found = fault_cases.workers_of(fake_rank.pid, 10)
    assert fake_rank.stdout.readline() == b"ready\n"
    import psutil

    assert len(found) == 1 and psutil.Process(found[0]).status() != psutil.STATUS_ZOMBIE


def test_workers_of_names_what_it_saw_at_its_bound():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        with pytest.raises(AssertionError, match=rf"no DataLoader worker under rank pid {proc.pid} within 0 s "
                                                 r"\(its children: none\)"):
            fault_cases.workers_of(proc.pid, 0.3)
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(AssertionError, match=rf"rank pid {proc.pid} ended before a DataLoader worker was seen"):
        fault_cases.workers_of(proc.pid, 5)


class _Listed:
    def __init__(self, pid: int, ppid: int, rank: str):
        self.pid, self._ppid, self._rank = pid, ppid, rank
        self.info = {"cmdline": [sys.executable, "-m", "dsrecipes.rank.worker", "--run-dir", "r"]}

    def environ(self):
        return {"RANK": self._rank}

    def ppid(self):
        return self._ppid


def test_ranks_are_ranks_whatever_the_listing_order(monkeypatch):
    """Before: the first process listed for a RANK won, so a worker with a lower (wrapped-around) pid than its rank
    was taken for the rank, and workers_of() waited 30 s under it for workers it never has."""
    listed = [_Listed(100, 900, "1"), _Listed(101, 901, "0"), _Listed(900, 50, "1"), _Listed(901, 50, "0")]
    monkeypatch.setattr(fault_cases, "session", lambda sid: listed)
    assert fault_cases.ranks(50) == [901, 900]


def test_a_worker_that_ended_before_its_kill_is_replaced(monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    answers = iter([[gone.pid], [live.pid]])
    monkeypatch.setattr(fault_cases, "workers_of", lambda pid, bound: next(answers))
    try:
        fault_cases.kill_a_worker(1, 10)
        assert live.wait(timeout=10) == -signal.SIGKILL
    finally:
        live.kill()
        live.wait()
