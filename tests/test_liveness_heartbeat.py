"""A rank whose collective broke because another rank failed on its own (that rank's report is already in
failure.json) does not hold itself up looking for a lost peer (heartbeat.explain_crash: CRASH_GRACE_S + 3 beats, 7 s):
the first report stands whatever it would find. Measured on the fault matrix's iterable-w2-r2-worker_killed case:
13.8 s from the worker's SIGKILL to the end of every process before (the failing rank looked 7 s, then the other
one 4 s + the launching process's 5 s grace), 1.6 s after. A report from before this session does not count."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

import dsrecipes.core.heartbeat as heartbeat
from tests.test_liveness_stall import no_product_thread_left  # noqa: F401 - an autouse fixture


@contextlib.contextmanager
def beating(run_dir, monkeypatch, world: int):
    """Rank 0's heartbeat of a `world`-rank run, beating (a thread, no store), with a short crash grace."""
    monkeypatch.setattr(heartbeat, "CRASH_GRACE_S", 0.5)
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.1)
    hb = heartbeat.Heartbeat(run_dir, 0, world, 30.0)
    hb._thread = threading.Thread(target=hb._stop.wait, daemon=True)
    hb._thread.start()
    try:
        yield hb
    finally:
        hb._stop.set()
        hb._thread.join(timeout=1)


@pytest.fixture
def beat(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with beating(tmp_path, monkeypatch, 2) as hb:
        yield hb


def _looked(hb) -> float:
    started = time.monotonic()
    hb.explain_crash()
    return time.monotonic() - started


def test_a_peer_that_reported_its_own_failure_is_not_looked_for(beat, tmp_path):
    heartbeat.write_failure(tmp_path, {"rank": 1, "cause": "DataLoader worker 0 (pid 7) was killed by SIGKILL",
                                       "time": time.time()})
    assert _looked(beat) < 0.3  # before: the whole look (0.5 + 3 x 0.1 s here, 7 s in a run)


def test_without_a_report_of_this_session_the_peers_are_looked_at(beat, tmp_path):
    heartbeat.write_failure(tmp_path, {"rank": 1, "cause": "an earlier session's", "time": beat.started - 60})
    assert _looked(beat) >= 0.7
