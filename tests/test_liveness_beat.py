"""What one beat costs the job's store (core/heartbeat.py). Every rank beats once a second in the TCPStore of rank 0
(or torchrun's agent): at hundreds of ranks each call a beat makes is hundreds of calls a second on one thread of one
process. A rank made two a beat: its counter, and a look whether some rank published a failure report. Now the
report's news comes in the counter's own answer (the reporter adds heartbeat.FAILED to every rank's counter), so a
rank makes one call a beat and reads the report only once it is there. Ranks of one in-process TCPStore, beats every
0.05 s (tests/test_liveness_stall.py's job)."""

from __future__ import annotations

import time

import pytest

import dsrecipes.core.heartbeat as heartbeat
from tests.test_liveness_stall import job, mark, no_product_thread_left, wait_for  # noqa: F401 - fixtures

BEATS = 8


class Counting:
    """The store of one rank, counting the calls its heartbeat makes (name, first key)."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        call = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls.append((name, args[0] if args else None))
            return call(*args, **kwargs)

        return counted


def beats(counted: Counting, hb) -> int:
    return sum(1 for name, key in counted.calls if name == "add" and key == hb._key("beat", hb.rank))


def test_a_rank_makes_one_store_call_per_beat(job):  # noqa: F811
    """Measured: 2 calls a beat before (add, check), 1 now; the first rank of a node, which also reads everyone's
    counter and place, 3 (was 5: add, check, check, multi_get, multi_get)."""
    r0, r1 = job(0, 0)
    time.sleep(0.1)  # both placed and beating: the steady state
    c0, c1 = Counting(r0.store), Counting(r1.store)
    r0.store, r1.store = c0, c1
    assert wait_for(lambda: beats(c1, r1) >= BEATS and beats(c0, r0) >= BEATS, 5), (c0.calls, c1.calls)
    r0.store, r1.store = c0.store, c1.store
    n1, n0 = beats(c1, r1), beats(c0, r0)
    assert len(c1.calls) <= n1 + 1, c1.calls  # (+1: a beat's call in flight when counting stopped)
    assert len(c0.calls) <= 3 * (n0 + 1), c0.calls
    assert not job.exits


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's stand-in exit
def test_a_report_reaches_every_rank_in_its_next_beat(job, tmp_path):  # noqa: F811
    """Rank 1 stalls; rank 0 reports it and tells the others through their counters; ranks 1 and 2 stop within a few
    beats, each having read the same report (one get), and the counts a reader sees stay counts."""
    r0, r1, r2 = job(0, 0.5, world_size=3)
    time.sleep(0.2)
    counted = Counting(r2.store)
    r2.store = counted
    mark(r1.progress, "data", 12)
    assert wait_for(lambda: len(job.exits) == 3, 5), job.exits
    record = heartbeat.read_failure(tmp_path)
    assert [w["rank"] for w in record["stalled"]] == [1] and job.followed == {1: record, 2: record}, job.followed
    assert [name for name, _ in counted.calls].count("get") == 1, counted.calls
    seen = r0.read_beats()
    assert all(value == heartbeat.DONE or int(value) < 1000 for value in seen.values()), seen


def test_a_reader_sees_counts_and_done_whatever_was_added(tmp_path):
    """FAILED added to a counter is news, not progress: a silent rank does not look like it beat once more; a rank
    that stopped reads as done even after a report was published (no add ever meets a word: torch's store closes
    the adder's connection on a counter that is not a number)."""
    import torch.distributed as dist

    hb = heartbeat.Heartbeat(tmp_path, 0, 3, 30.0)
    hb.store = dist.HashStore()
    for r in range(3):
        hb.store.add(hb._key("beat", r), 5)
    hb.store.set(hb._key("beat", 2), str(heartbeat.DONE_MARK))
    for r in range(3):
        hb.store.add(hb._key("beat", r), heartbeat.FAILED)
    assert hb.read_beats() == {0: b"5", 1: b"5", 2: heartbeat.DONE}
