"""The stall watchdog (core/stall.py on core/heartbeat.py): a live rank that makes no step progress is named on the
console every launcher.stall_warn_s, and ends the run at launcher.stall_timeout_s with <run>/failure.json saying
"stalled". Two Heartbeat objects of one in-process TCPStore, beats every 0.05 s, bounds of tenths of a second; the
watchdog's judgement itself on a fake clock. Before it, a rank stuck waiting for its next batch (a DataLoader worker
alive but never answering) kept beating, and its peers waited for the process-group timeout without a line."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest

import dsrecipes.core.heartbeat as heartbeat
from dsrecipes.core import stall


@pytest.fixture
def job(tmp_path, monkeypatch):
    """start(warn_s, timeout_s, world_size=2) -> the Heartbeats of ranks 0, 1, ..., each with its own Progress (rank 0
    reads the counters). `exits` lists the codes a failing heartbeat exits with (its thread ends there instead),
    `followed` the report each rank that followed another's read. Every heartbeat is stopped (its threads joined)
    before os._exit is itself again."""
    import torch.distributed as dist

    from dsrecipes.core.distributed import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CROSS_RANK", "0")
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.05)
    exits = []

    def exit_thread(code):
        exits.append(code)
        start.exiting.append(threading.get_ident())
        raise SystemExit(code)  # ends the heartbeat thread quietly, not the test process

    monkeypatch.setattr(heartbeat.os, "_exit", exit_thread)
    followed, exit_as = {}, heartbeat.Heartbeat._exit

    def exit_noting(self, first, mine):
        if not mine:
            followed[self.rank] = first
        exit_as(self, first, mine)

    monkeypatch.setattr(heartbeat.Heartbeat, "_exit", exit_noting)
    beats = []

    def start(warn_s, timeout_s, world_size=2):
        for rank in range(world_size):
            hb = heartbeat.Heartbeat(tmp_path, rank, world_size, 10.0, stall.Watch(warn_s, timeout_s))
            hb.monitor, hb.progress = rank == 0, stall.Progress()
            beats.append(hb)
        for hb in beats:
            hb.progress.step, hb.progress.phase = 12, "compute"
            hb.start()
        return beats

    start.exits, start.exiting, start.followed = exits, [], followed  # the codes, the threads that exited, in order
    yield start
    for hb in beats:
        hb.stop()
    del server


@pytest.fixture(autouse=True)
def no_product_thread_left():
    """No thread of the product (`dsrecipes-*`: a heartbeat's, the final barrier's watch) outlives its test: one
    would go on beating in a store that is gone, and its os._exit would be the real one (tests/conftest.py)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and _product_threads(before):
        time.sleep(0.02)
    assert not _product_threads(before), "alive after the test (and its fixtures' teardown)"


def _product_threads(before):
    return [t.name for t in threading.enumerate() if t.name.startswith("dsrecipes-") and t not in before]


def mark(progress, phase, step):
    progress.step, progress.phase, progress.moves = step, phase, progress.moves + 1


def wait_for(condition, bound_s):
    deadline = time.monotonic() + bound_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_rank_waiting_for_its_batch_is_named_once_per_interval(job, capsys):
    r0, r1 = job(0.4, 0)
    mark(r1.progress, "data", 12)  # rank 1 waits for its next batch; rank 0 sits in its collective (compute)
    time.sleep(1.3)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "waiting" in ln]
    assert 1 <= len(lines) <= 3, lines  # one per 0.4 s of no progress, not one per beat
    assert "rank 1 (node" in lines[0] and "at step 12, phase data (next batch) for" in lines[0], lines
    assert "rank 0" not in lines[0] and "launcher.stall_timeout_s=0" in lines[0], lines
    assert not job.exits


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's stand-in exit
def test_past_the_timeout_the_run_ends_naming_the_stalled_rank_and_phase(job, tmp_path, capsys):
    r0, r1 = job(0.2, 0.6)
    started = time.monotonic()
    mark(r1.progress, "data", 12)
    assert wait_for(lambda: job.exits, 5), capsys.readouterr().err
    assert 0.6 <= time.monotonic() - started < 3
    assert wait_for(lambda: len(job.exits) == 2, 5) and job.exits == [heartbeat.PEER_LOST_EXIT] * 2  # and rank 1
    record = heartbeat.read_failure(tmp_path)
    assert record["lost"] == [] and [(w["rank"], w["step"], w["phase"]) for w in record["stalled"]] == [(1, 12, "data")]
    message = heartbeat.describe_failure(record)
    assert message.startswith("the run stalled: rank 1 (node") and "phase data (next batch)" in message, message
    assert "launcher.stall_timeout_s=1" in message and "stopped responding" not in message, message
    assert "the run stalled: rank 1" in capsys.readouterr().err


@pytest.fixture
def failure_lookups(monkeypatch):
    """The file-system lookups of <run>/failure.json (opened, stat'ed: is_file, exists) from now on."""
    from pathlib import Path

    looked = []

    def counting(method):
        def wrapper(self, *args, **kwargs):
            if Path(self).name == heartbeat.FAILURE_FILE:
                looked.append(method.__name__)
            return method(self, *args, **kwargs)

        return wrapper

    for name in ("open", "stat"):
        monkeypatch.setattr(Path, name, counting(getattr(Path, name)))
    return looked


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's stand-in exit
def test_a_report_reaches_the_other_ranks_through_the_store(job, tmp_path, failure_lookups):
    """A rank learns that another rank's heartbeat ended the run from the store it beats in anyway, not by looking
    at failure.json every beat (hundreds of ranks on a shared file system); the reporter (rank 0: under
    launcher=deepspeed the store's host) exits after the others read it, so none meets a store gone (a C++ stack)."""
    r0, r1 = job(0, 0.8)
    time.sleep(0.3)  # 6 beats of each rank: before, 12 opens of failure.json
    assert failure_lookups == [] and not job.exits
    mark(r1.progress, "data", 12)  # rank 1 stalls: rank 0 reports it, rank 1 follows
    assert wait_for(lambda: len(job.exits) == 2, 5), job.exits
    r0._thread.join(timeout=5)
    assert not r0._thread.is_alive() and job.exits == [heartbeat.PEER_LOST_EXIT] * 2
    assert r1._thread.ident in job.exiting[:1], "the reporter exited first: its store gone under the others"
    assert failure_lookups == [] and heartbeat.read_failure(tmp_path)["stalled"][0]["rank"] == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's stand-in exit
def test_a_rank_whose_store_is_gone_after_a_report_stops_quietly(job, tmp_path, capsys):
    """The reporter did not wait for this rank (it exited; its store with it): the file, the durable record, says
    the run is over; this rank stops without a report or a line of its own."""
    r0, r1 = job(0, 0)
    report = {"lost": [{"rank": 0, "node": 0, "host": "h"}], "reason": "no heartbeat for 10 s", "time": time.time()}
    heartbeat.write_failure(tmp_path, report)

    class Gone:
        def __getattr__(self, name):
            raise RuntimeError("Connection reset by peer")

    r0._stop.set()
    r1.store = Gone()
    assert wait_for(lambda: job.exits, 5) and job.exits == [heartbeat.PEER_LOST_EXIT]
    assert heartbeat.read_failure(tmp_path) == report and "dsrecipes" not in capsys.readouterr().err


def test_ranks_that_make_progress_never_trigger_it(job, capsys):
    r0, r1 = job(0.3, 0.5)
    for step in range(13, 13 + 40):  # 1.2 s of steps of 30 ms: data, then compute, on both ranks
        for hb in (r0, r1):
            mark(hb.progress, "data", step - 1)
            mark(hb.progress, "compute", step - 1)
        time.sleep(0.03)
    assert not job.exits and "waiting" not in capsys.readouterr().err


def test_the_rank_furthest_behind_is_named_and_setup_only_warns():
    watch = stall.Watch(warn_s=10, timeout_s=20)
    positions = {0: "12 compute 5", 1: "12 data 4", 2: "12 checkpoint 9", 3: None}  # rank 3: done
    assert watch.observe(positions, 0.0) is None
    kind, behind, quiet = watch.observe(positions, 10.0)
    assert kind == "warn" and quiet == 10.0 and [r for r, *_ in behind] == [2]  # step 12's checkpoint comes first
    assert watch.observe(positions, 15.0) is None  # one line per interval
    assert watch.observe(positions, 20.0)[0] == "fail"
    setup = stall.Watch(warn_s=10, timeout_s=20)
    setup.observe({0: "0 start 0", 1: "0 data 3"}, 0.0)
    assert setup.observe({0: "0 start 0", 1: "0 data 3"}, 100.0)[0] == "warn"  # setup has its own bounds


def test_the_main_thread_marks_without_io():
    stall.reset()
    stall.mark("data", 7)
    assert stall.current.encode() == "7 data 1" and stall.decode("7 data 1") == (7, "data", 1)
    assert stall.decode("7 nowhere 1") is None
    stall.reset()


@pytest.mark.parametrize("warn, timeout, problem", [
    (120, 1800, None), (0, 0, None), (60, 0, None),
    (-1, 1800, "launcher.stall_warn_s: whole seconds >= 0 (0: off), got -1"),
    (60, -5, "launcher.stall_timeout_s: whole seconds >= 0 (0: off), got -5"),
    (600, 300, "launcher.stall_warn_s: must be <= launcher.stall_timeout_s (300) so the warning comes before the run "
               "ends, got 600"),
])  # fmt: skip
def test_the_bounds_are_validated_with_their_key(warn, timeout, problem):
    from dsrecipes.config.launcher_rules import launcher_problems
    from dsrecipes.core.schema import TrainConfig

    cfg = TrainConfig()
    assert (cfg.launcher.stall_warn_s, cfg.launcher.stall_timeout_s) == (120, 1800)
    cfg.launcher.stall_warn_s, cfg.launcher.stall_timeout_s = warn, timeout
    stalls = [p for p in launcher_problems(cfg) if "stall" in p]
    assert stalls == ([problem] if problem else [])


def test_a_lone_rank_gets_the_watchdog_unless_the_heartbeat_is_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(heartbeat.Heartbeat, "start", lambda self: None)  # no store: whether it would start
    monkeypatch.setattr(heartbeat, "_current", None)
    assert heartbeat.start(tmp_path, 0, 1, 30, 0, 0) is None  # nothing to watch (before: never for one rank)
    assert heartbeat.start(tmp_path, 0, 1, 0, 60, 600) is None  # launcher.peer_timeout_s=0: no watchdog either
    lone = heartbeat.start(tmp_path, 0, 1, 30, 60, 600)
    assert lone is not None and (lone.watch.warn_s, lone.watch.timeout_s) == (60, 600)
    stopped = []
    monkeypatch.setattr(heartbeat.Heartbeat, "stop", lambda self: stopped.append(self.world_size))
    heartbeat.stop_alone()  # its setup failed: the watchdog does not outlive the in-process run
    assert stopped == [1] and heartbeat._current is None
    heartbeat.start(tmp_path, 1, 2, 30, 60, 600)
    heartbeat.stop_alone()  # a rank of a job keeps beating for explain_crash
    assert stopped == [1] and heartbeat._current is not None


@pytest.mark.parametrize("master", [None, "1"])
def test_a_lone_rank_watchdog_needs_no_served_store(tmp_path, monkeypatch, master):
    """launcher=local runs its one rank in the launching process, where no store is served at MASTER_ADDR:MASTER_PORT
    (or none is set): the lone watchdog keeps its positions in this process. A first version connected a TCPStore
    client there and waited launcher.peer_timeout_s (30 s) in every in-process run, then ran without a watchdog."""
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    if master is not None:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", master)  # nothing listens on port 1
    monkeypatch.setattr(heartbeat, "_current", None)
    began = time.monotonic()
    lone = heartbeat.start(tmp_path, 0, 1, 30, 60, 600)
    try:
        assert lone is not None and time.monotonic() - began < 5
        assert lone._thread.is_alive() and int(lone.store.add(lone._key("beat", 0), 0)) >= 1
    finally:
        heartbeat.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's stand-in exit
def test_a_stalled_in_process_run_ends_as_any_failed_run(tmp_path, monkeypatch, capsys):
    """launcher=local: the lone rank runs in the launching process, so the watchdog's exit skipped everything the
    launching process does after a run: no result.json, no `error:` line, and the rank's DataLoader workers (the
    stuck one included) left running. Now it prints the error line, ends the workers and records the outcome."""
    import multiprocessing

    from dsrecipes.core.rundir import RESULT_FILE
    from dsrecipes.data.strategies.base import end_workers

    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.05)
    monkeypatch.setattr(heartbeat, "_current", None)
    exits = []

    def exit_thread(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(heartbeat.os, "_exit", exit_thread)
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    worker.start()  # a DataLoader worker that never answers
    lone = None
    try:
        lone = heartbeat.start(tmp_path, 0, 1, 30, 0, 1, in_process=True, before_exit=end_workers)
        stall.mark("data", 3)
        assert wait_for(lambda: exits, 5) and exits == [heartbeat.PEER_LOST_EXIT], capsys.readouterr().err
        lone._thread.join(timeout=5)
        result = json.loads((tmp_path / RESULT_FILE).read_text())
        assert (result["status"], result["exit_code"]) == ("failed", heartbeat.PEER_LOST_EXIT), result
        assert result["error"].startswith("the run stalled: rank 0 (") and "phase data (next batch)" in result["error"]
        err = capsys.readouterr().err
        assert "error: the run stalled: rank 0 (" in err and "launcher.stall_timeout_s=1" in err, err
        assert not worker.is_alive()  # killed, and reaped
    finally:
        worker.kill()
        if lone is not None:
            lone.stop()  # its guard (this test's stand-in exit ended only the beating thread)
        heartbeat._current = None
        stall.reset()
