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
from dsrecipes.core.locks import PROBE_S, ExclusiveLock, LockHeld, is_held, probe_held
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


def test_probe_held_says_unknown_on_an_error_and_false_only_when_free_or_gone(tmp_path, monkeypatch):
    import errno

    import dsrecipes.core.locks as locks

    path = tmp_path / NODE_LOCK.format(1)
    assert probe_held(path) is False  # (no file: nobody holds it)
    lock = ExclusiveLock(path, {"node_rank": 1}).acquire()
    assert probe_held(path) is True
    real_open, real_flock = os.open, locks.fcntl.flock

    def stale_open(name, *args, **kwargs):
        if Path(name) == path:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(locks.os, "open", stale_open)
    assert probe_held(path) is None
    assert is_held(path) is False  # (is_held's answer for the others: they only ask before or after)
    monkeypatch.setattr(locks.os, "open", real_open)

    def no_lock(fd, mode):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locks.fcntl, "flock", no_lock)
    assert probe_held(path) is None
    monkeypatch.setattr(locks.fcntl, "flock", real_flock)
    lock.release()
    assert probe_held(path) is False


def _watch_through_stale_probes(lock_path: str, flaky: str, log: str) -> None:
    """A rank's launcher watcher (rank/worker.watch_launcher) in its own process: opening the lock fails with ESTALE
    while `flaky` exists (an NFS client's hiccup); SIGTERM (the watcher's stop) is written to `log` and ends it."""
    import errno
    import signal
    import sys

    import dsrecipes.rank.worker as worker

    err = open(log, "a", buffering=1)
    os.dup2(err.fileno(), 2)
    sys.stderr = err
    real_open = os.open

    def flaky_open(name, *args, **kwargs):
        if str(name) == lock_path and os.path.exists(flaky):
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(name, *args, **kwargs)

    def stopped(*_):
        print("SIGTERM received", file=sys.stderr, flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stopped)
    worker.LAUNCHER_POLL_S = 0.1
    worker.read_plan = lambda run_dir: type("Plan", (), {"exports": {}})()
    worker.load_run_config = lambda run_dir: type("Cfg", (), {"trainer": type("T", (), {"stop_grace_s": 1})})()
    worker.node_lock = lambda run_dir: Path(lock_path)
    worker.watch_launcher(Path(lock_path).parent)
    os.open = flaky_open
    time.sleep(120)


def test_a_rank_keeps_training_while_the_node_lock_cannot_be_probed_and_stops_when_it_is_free(tmp_path):
    """Was: the watcher's probe (is_held) answered 'not held' when opening the lock file failed, so one transient
    ESTALE of shared storage stopped every rank of the node as if its `dsrecipes node` had died; an flock error ended
    the watcher thread with a traceback (and nothing watched any more). Now: a line saying it cannot tell, training
    on, a line when the lock is seen again, and the stop only once the lock is really free."""
    path, flaky, log = tmp_path / NODE_LOCK.format(1), tmp_path / "flaky", tmp_path / "watcher.log"
    lock = ExclusiveLock(path, {"node_rank": 1}).acquire()
    flaky.touch()
    child = multiprocessing.get_context("spawn").Process(target=_watch_through_stale_probes,
                                                         args=(str(path), str(flaky), str(log)), daemon=True)
    child.start()
    try:
        deadline = time.monotonic() + 60
        while "cannot tell" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # (ten probes failing)
        text = log.read_text()
        assert "cannot tell whether this node's `dsrecipes node`" in text and "SIGTERM" not in text, text
        flaky.unlink()
        while "seen alive again" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "SIGTERM" not in log.read_text() and child.is_alive()
        lock.release()
        child.join(30)
        text = log.read_text()
        assert "is gone; stopping" in text and "SIGTERM received" in text, text
        assert text.count("cannot tell") == 1 and "Traceback" not in text
    finally:
        child.kill()
        child.join(10)


def test_a_storage_error_is_not_the_launching_process_gone(tmp_path, monkeypatch):
    """rundir.launcher_alive is what rank 0 asks at every step boundary (rank/train.stop_requested) and its watchdog
    every 2 s (core/stopping.watch), and what node 1 asks before it joins (run/join.ready). Was: an error opening the
    lock (NFS ESTALE) answered 'gone', and a step later every rank checkpointed and stopped as if the launching
    process had died. Now only a lock seen free, or no lock file, is gone."""
    import errno

    import dsrecipes.core.locks as locks
    from dsrecipes.core.rundir import LOCK_FILE, launcher_alive

    assert launcher_alive(tmp_path) is False  # (no lock file: no launching process)
    lock = ExclusiveLock(tmp_path / LOCK_FILE, {"pid": os.getpid()}).acquire()
    assert launcher_alive(tmp_path) is True
    real_open = os.open

    def stale_open(name, *args, **kwargs):
        if Path(name).name == LOCK_FILE:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(locks.os, "open", stale_open)
    assert launcher_alive(tmp_path) is True
    monkeypatch.setattr(locks.os, "open", real_open)
    lock.release()
    assert launcher_alive(tmp_path) is False
