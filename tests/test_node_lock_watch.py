"""The ranks of a node > 0 started by `dsrecipes node` watch its node lock (rank/worker.watch_launcher), named to them
in DSRECIPES_NODE_LOCK (core/runplan.node_lock); the end-to-end case (node 1's `dsrecipes node` SIGKILLed mid-run:
every rank saves and stops) is tests/test_review_node_join.py::test_node_1s_joiner_sigkilled_... on two nodes."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from dsrecipes.boundary.rank_env import checked_env
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.locks import PROBE_S, ExclusiveLock, LockHeld, is_held
from dsrecipes.core.runplan import NODE_LOCK, NODE_LOCK_ENV, node_lock


def test_only_a_node_lock_directly_in_the_run_directory_is_watched(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.delenv(NODE_LOCK_ENV, raising=False)
    assert node_lock(run) is None
    good = run / NODE_LOCK.format(3)
    monkeypatch.setenv(NODE_LOCK_ENV, str(good))
    assert node_lock(run) == good
    for other in (tmp_path / NODE_LOCK.format(3), run / "sub" / NODE_LOCK.format(3), run / ".dsrecipes.lock",
                  run / NODE_LOCK.format(0), run / ".dsrecipes.node1.lock.x", "/etc/passwd"):
        monkeypatch.setenv(NODE_LOCK_ENV, str(other))
        assert node_lock(run) is None, other


def test_a_recipe_cannot_name_the_node_lock():
    with pytest.raises(ConfigError):
        checked_env({NODE_LOCK_ENV: "/tmp/anything"})


def test_is_held_sees_the_holder_and_a_fifo_is_no_wait(tmp_path):
    path = tmp_path / NODE_LOCK.format(1)
    lock = ExclusiveLock(path, {"node_rank": 1}).acquire()
    assert is_held(path)
    lock.release()
    assert not is_held(path)
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    started = time.monotonic()
    assert not is_held(fifo)  # was: open() waited for a writer for ever
    assert time.monotonic() - started < 5


def _probe_for_ever(path: str, probing) -> None:
    is_held(Path(path))
    probing.set()
    while True:
        is_held(Path(path))


def test_a_claim_is_not_refused_because_someone_probes_the_lock(tmp_path):
    """Found by the review of `dsrecipes node`: a process probing a run's lock in a loop (is_held: a shared flock for
    an instant) made 24,165 of 225,049 exclusive claims fail at once ('in use by another run'): node 0's start could
    be refused by node 1's wait. Now a claim tries again for up to PROBE_S before it says the lock is held."""
    path = tmp_path / ".dsrecipes.lock"
    path.touch()
    context = multiprocessing.get_context("spawn")
    probing = context.Event()
    prober = context.Process(target=_probe_for_ever, args=(str(path), probing), daemon=True)
    prober.start()
    try:
        assert probing.wait(60)
        for _ in range(20000):  # (with PROBE_S = 0: 55 of 20000 refused here, under load)
            ExclusiveLock(path).acquire().release()
    finally:
        prober.kill()
        prober.join(10)


def test_a_real_holder_is_still_refused_at_once(tmp_path):
    path = tmp_path / ".dsrecipes.lock"
    held = ExclusiveLock(path, {"who": "first"}).acquire()
    started = time.monotonic()
    with pytest.raises(LockHeld):
        ExclusiveLock(path).acquire()
    assert time.monotonic() - started < PROBE_S + 1.0
    held.release()
