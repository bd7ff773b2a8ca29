"""The ranks of a node > 0 started by `dsrecipes node` watch its node lock (rank/worker.watch_launcher), named to them
in DSRECIPES_NODE_LOCK (core/runplan.node_lock); the end-to-end case (node 1's `dsrecipes node` SIGKILLed mid-run:
every rank saves and stops) is tests/test_review_node_join.py::test_node_1s_joiner_sigkilled_... on two nodes."""

from __future__ import annotations

import os
import time

import pytest

from dsrecipes.boundary.rank_env import checked_env
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.locks import ExclusiveLock, is_held
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
