"""The waits around the process group that only its timeout (30 minutes) bounded:

- joining it: ranks that met at the rendezvous (core/rendezvous.py) waited in init_process_group for a rank that died
  or stopped right after; the heartbeat started only once the group was up. Now every rank starts its heartbeat
  right after the rendezvous (rank/session.meet_and_beat), a rank that never beats counts as silent from the first
  look, and a line says what the join waits for (core/distributed.noting).
- the final barrier: every rank stops its heartbeat before it (ranks that finish first are not taken for dead), so a
  peer that froze or died on its way there held the others. Now core/final_barrier.py watches it: a peer not
  arrived that no longer beats is named after launcher.peer_timeout_s; one still beating is waited for.

Heartbeats of two ranks in this process on an in-process TCPStore, beats every 0.05 s, bounds of half a second.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest

import dsrecipes.core.final_barrier as final_barrier
import dsrecipes.core.heartbeat as heartbeat
from dsrecipes.core import stall
from tests.test_liveness_stall import no_product_thread_left, wait_for  # noqa: F401 - an autouse fixture

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # stand-in exits

TIMEOUT_S = 0.5


@pytest.fixture
def ranks(tmp_path, monkeypatch):
    """make(rank) -> a Heartbeat of a 2-rank job (not started); `exits` lists the codes a failing one exits with
    (its thread ends there instead of this process)."""
    import torch.distributed as dist

    from dsrecipes.core.distributed import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": "0", "CROSS_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.05)
    monkeypatch.setattr(final_barrier, "FINAL_NOTE_S", 0.2)
    monkeypatch.setattr(heartbeat, "QUIET_S", 0.125)
    exits, made = [], []

    def exit_thread(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(heartbeat.os, "_exit", exit_thread)

    def make(rank):
        hb = heartbeat.Heartbeat(tmp_path, rank, 2, TIMEOUT_S, stall.Watch(0, 0))
        hb.monitor, hb.progress = rank == 0, stall.Progress()
        made.append(hb)
        return hb

    make.exits = exits
    yield make
    for hb in made:
        hb.stop()  # its threads joined before os._exit is itself again
    del server


def test_a_rank_that_never_beats_is_named_after_the_timeout(ranks, tmp_path):
    r0 = ranks(0)
    r0.start()  # rank 1 met the others, then died before its heartbeat (and the process group) started
    started = time.monotonic()
    assert wait_for(lambda: ranks.exits, 5), "rank 0 waits for rank 1 for ever (before: it was never looked at)"
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 2
    record = heartbeat.read_failure(tmp_path)
    assert [w["rank"] for w in record["lost"]] == [1] and "no heartbeat for" in record["reason"], record


def test_the_heartbeat_starts_between_the_rendezvous_and_the_join(tmp_path, monkeypatch):
    """rank/session.start: meet, heartbeat, then the process group (before: the heartbeat after the join)."""
    from dsrecipes.core.schema import TrainConfig
    from dsrecipes.rank import session

    calls = []

    class Joined(Exception):
        pass

    def init_distributed(before_join):
        before_join()
        calls.append("join")
        raise Joined

    monkeypatch.setattr(session, "load_deepspeed", lambda: None)
    monkeypatch.setattr(session, "read_plan", lambda run_dir: None)
    monkeypatch.setattr(session, "check_plan_current", lambda plan, run_dir: None)
    monkeypatch.setattr(session, "init_distributed", init_distributed)
    monkeypatch.setattr(session.rendezvous, "meet", lambda timeout_s: calls.append("meet"))
    monkeypatch.setattr(session.heartbeat, "start", lambda *a, **k: calls.append(("heartbeat", a[1:4])))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Joined):
        session.start(TrainConfig(), tmp_path)
    assert calls == ["meet", ("heartbeat", (1, 2, 30)), "join"]


def test_the_join_is_named_while_it_lasts(capsys, monkeypatch):
    from dsrecipes.core.distributed import noting

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with noting("starting the process group", first_s=0.1):
        time.sleep(0.65)  # lines at 0.1 and 0.4 s
    time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("dsrecipes: rank 3: starting the process group: 0 s so far"), lines


def test_a_peer_frozen_before_the_final_barrier_is_named(ranks, tmp_path, monkeypatch, capsys):
    r0, r1 = ranks(0), ranks(1)
    r0.start(), r1.start()
    time.sleep(0.2)
    r1.stop()  # rank 1 stopped its heartbeat, then froze before the barrier
    r0.stop()
    monkeypatch.setattr(heartbeat, "_stopped", r0)
    held = threading.Event()  # the barrier: rank 1 never comes (released once rank 0's watch ended it)
    at = threading.Thread(target=final_barrier.final_barrier, args=(lambda: held.wait(10),), daemon=True)
    started = time.monotonic()
    at.start()
    try:
        assert wait_for(lambda: ranks.exits, 5), "rank 0 waits at the barrier for ever (before: unwatched)"
        assert time.monotonic() - started < TIMEOUT_S + 2
    finally:
        held.set()
    record = heartbeat.read_failure(tmp_path)
    assert [w["rank"] for w in record["lost"]] == [1] and "final barrier" in record["reason"], record
    err = capsys.readouterr().err
    assert "rank 1 (node 0" in err and "stopped responding" in err, err


def test_a_peer_still_beating_is_waited_for_and_the_barrier_ends_when_it_arrives(ranks, monkeypatch, capsys):
    r0, r1 = ranks(0), ranks(1)
    r0.start(), r1.start()
    time.sleep(0.2)
    r0.stop()  # rank 0 is at the barrier; rank 1 is still finishing (closing its trackers): beating
    monkeypatch.setattr(heartbeat, "_stopped", r0)
    held = threading.Event()
    at = threading.Thread(target=final_barrier.final_barrier, args=(lambda: held.wait(10),), daemon=True)
    at.start()
    time.sleep(3 * TIMEOUT_S)
    assert not ranks.exits
    err = capsys.readouterr().err
    assert "at the run's final barrier for rank 1 (node 0" in err and "launcher.peer_timeout_s=0" in err, err
    r1.stop()
    final_barrier.arrive(r1)  # rank 1 arrives: the barrier ends
    held.set()
    at.join(timeout=5)
    time.sleep(0.3)
    assert not at.is_alive() and not ranks.exits


def test_the_waiting_line_comes_from_a_rank_that_waits(ranks, monkeypatch, capsys):
    """Rank 0, its node's first rank, is the late one: rank 1, the lowest of the node's ranks at the barrier, says
    what it waits for (before: only the first rank of each node printed, so nobody did)."""
    r0, r1 = ranks(0), ranks(1)
    r0.start(), r1.start()
    time.sleep(0.2)
    r1.stop()  # rank 1 is at the barrier; rank 0 is still finishing: beating
    monkeypatch.setattr(heartbeat, "_stopped", r1)
    held = threading.Event()
    at = threading.Thread(target=final_barrier.final_barrier, args=(lambda: held.wait(10),), daemon=True)
    at.start()
    err = []
    try:
        assert wait_for(lambda: err.append(capsys.readouterr().err) or "final barrier" in "".join(err), 2), err
    finally:
        held.set()
    at.join(timeout=5)
    line = "".join(err)
    assert "dsrecipes: rank 1: waiting 0 s at the run's final barrier for rank 0 (node 0" in line and not ranks.exits


def test_a_waiting_rank_reads_who_arrived_in_one_call_whatever_the_world_size(ranks, tmp_path, monkeypatch):
    """Each waiting rank looks once a beat: a key per rank looked up one by one (before: 64 calls a beat in a job of
    64 ranks, world size squared calls a second on the store) is one list read in one call."""
    calls = []

    class Counting:
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            calls.append(name)
            return getattr(self.store, name)

    hb = heartbeat.Heartbeat(tmp_path, 0, 64, 30.0, stall.Watch(0, 0))  # 63 ranks still beating, not at the barrier
    hb.start()
    hb.stop()
    for r in range(1, 64):
        hb.store.set(hb._key("who", r), json.dumps({"rank": r, "node": 0, "host": "h"}))
        hb.store.add(hb._key("beat", r), 1)
    hb.store = Counting(hb.store)
    monkeypatch.setattr(heartbeat, "_stopped", hb)
    held = threading.Event()
    at = threading.Thread(target=final_barrier.final_barrier, args=(lambda: held.wait(10),), daemon=True)
    at.start()
    try:
        assert wait_for(lambda: calls.count("multi_get") >= 4, 3), calls
    finally:
        held.set()
    at.join(timeout=5)
    looks = [c for c in calls if c != "append"]
    assert len(looks) <= 4 * calls.count("get") and not ranks.exits, calls  # arrived; beats: check, read; places
