"""A heartbeat's threads end with it (core/heartbeat.py). `Heartbeat.stop` waited for the beating thread as long as
the store's timeout (launcher.peer_timeout_s, 30 s) plus two beats, without a line; and a heartbeat whose beating
thread ended the run left its guard thread ticking where os._exit does not end the process (a test's stand-in:
measured alive 20 s after its test, for ever in fact). Now stop() is bounded (heartbeat.STOP_S) and names a store
call that did not return, and the guard ends with the beating thread. A lone rank's heartbeat (its store in this
process), beats every 0.05 s."""

from __future__ import annotations

import threading
import time

import pytest

import dsrecipes.core.heartbeat as heartbeat
from dsrecipes.core import stall
from tests.test_liveness_stall import no_product_thread_left, wait_for  # noqa: F401 - an autouse fixture


def heartbeat_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dsrecipes-heartbeat")]


class Held:
    """A store whose beats wait for `release` once `hold` is set (a store call on a network gone silent)."""

    def __init__(self, store):
        self.store, self.hold, self.release, self.held = store, threading.Event(), threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def add(self, key, value):
        if self.hold.is_set():
            self.held.set()
            self.release.wait(10)
        return self.store.add(key, value)


@pytest.fixture
def lone(tmp_path, monkeypatch):
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.05)
    hb = heartbeat.Heartbeat(tmp_path, 0, 1, 30.0, stall.Watch(60, 600))
    hb.progress = stall.Progress()
    hb.start()
    yield hb
    hb.stop()


def test_stop_is_bounded_and_names_a_store_call_that_does_not_return(lone, capsys):
    held = Held(lone.store)
    lone.store = held
    held.hold.set()
    assert held.held.wait(2)  # the beating thread is in a store call that does not return
    took = []
    began = time.monotonic()
    stopping = threading.Thread(target=lambda: (lone.stop(), took.append(time.monotonic() - began)))
    stopping.start()
    try:
        stopping.join(timeout=5)
        assert took and took[0] < 1.5, "stop() waited for the store call (before: 30 s + 2 beats)"
        err = capsys.readouterr().err
        assert f"rank 0: dsrecipes-heartbeat did not end in 1 s: the job's store at {lone._store_name()} did " \
            "not answer (this rank: done when it does" in err, err
        assert lone._guard_thread.is_alive(), "the guard watches the call on (it ends the rank past the timeout)"
    finally:
        held.release.set()
    assert wait_for(lambda: not heartbeat_threads(), 2), heartbeat_threads()  # the call returned: both end
    assert lone.read_beats() == {0: heartbeat.DONE}  # and the rank was marked done on the way out


def test_after_stop_both_threads_end_promptly(lone):
    time.sleep(0.2)
    began = time.monotonic()
    lone.stop()
    assert time.monotonic() - began < 0.5 and not heartbeat_threads(), heartbeat_threads()
    assert lone.read_beats() == {0: heartbeat.DONE}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's stand-in exit
def test_a_heartbeat_that_ended_the_run_leaves_no_thread(tmp_path, monkeypatch):
    """Its beating thread ended the run (a stall); os._exit is a stand-in that ends only that thread: the guard ends
    too, without a stop() (before: it ticked on until the process ended)."""
    exits = []

    def exit_thread(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(heartbeat.os, "_exit", exit_thread)
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.05)
    hb = heartbeat.Heartbeat(tmp_path, 0, 1, 30.0, stall.Watch(0.1, 0.2))
    hb.progress = stall.Progress()
    hb.progress.step, hb.progress.phase = 3, "data"  # waits for a batch that never comes
    hb.start()
    try:
        assert wait_for(lambda: exits, 5) and exits == [heartbeat.PEER_LOST_EXIT]
        assert wait_for(lambda: not heartbeat_threads(), 2), heartbeat_threads()
    finally:
        hb.stop()
