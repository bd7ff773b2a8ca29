"""core/worker_pool.py, the forked workers of `validate --all` and of the data preparation: every wait bounded, a
silent worker named on the console while the wait lasts, a dead or stuck one named (pid, exit code or signal) and
reaped, its tasks handed back; a worker deaf to SIGTERM killed within the bound; no process left after close()."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from dsrecipes.core.worker_pool import WorkerLost, WorkerPool


def _children():
    """This process's children, zombies too: a child not reaped is left behind as well."""
    return {c.pid for c in psutil.Process().children()}


@pytest.fixture
def no_child_left():
    before = _children()
    yield
    assert not _children() - before


def _pool(fn, processes=1, **kw):
    bounds = {"line_s": 0.2, "bound_s": 0.8, "reap_s": 0.5, "exit_wait_s": 0.6, **kw}
    return WorkerPool(processes, fn, label="testing", name="test worker",
                      waiting=lambda s, pids, tasks: f"testing: waiting {s:.1f} s for pid {pids} on {tasks}", **bounds)


def square(x):
    return x * x


def deaf_and_stuck(x):
    """Stuck in C: SIGTERM has no effect (its Python handler never runs)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(30)


def dies(code):
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)


def dies_unless_one(x):
    return square(x) if x != 1 else dies(-signal.SIGKILL)


def raises(x):
    raise ValueError(f"no {x}")


def echo(data):
    return data[::-1]


def _closes_its_answers_pipe(ino_and_then):
    """Closes its end of the answers pipe (`ino`: the pipe's inode), then, 0.3 s later, `then`: the order the kernel
    may take for a dying process under load (its pipes closed before its exit status is readable)."""
    ino, then = ino_and_then
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if os.fstat(fd).st_ino == ino:
                os.close(fd)
        except OSError:
            pass
    time.sleep(0.3)
    if then == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def test_answers_come_back_in_any_order_and_by_key(no_child_left):
    pool = _pool(square, processes=3)
    try:
        keys = [pool.submit(x) for x in range(20)]
        assert pool.next(keys[-1]) == (19, 361)
        got = dict(pool.next() for _ in range(19))
        assert got == {x: x * x for x in range(19)} and pool.pending == 0
    finally:
        started = time.monotonic()
        pool.close()
    assert time.monotonic() - started < 0.4  # idle workers end at once (no sibling holds their pipe open)


def test_a_large_task_and_answer_cross_the_pipes_whole(no_child_left):
    data = os.urandom(5 << 20)  # past any pipe's buffer: partial non-blocking writes and reads
    pool = _pool(echo, processes=2)
    try:
        keys = [pool.submit(data), pool.submit(data[:100])]
        assert pool.next(keys[0])[1] == data[::-1] and pool.next(keys[1])[1] == data[:100][::-1]
    finally:
        pool.close()


def test_a_tasks_exception_is_raised_here_and_the_pool_goes_on(no_child_left):
    pool = _pool(raises)
    try:
        with pytest.raises(ValueError, match="no 3"):
            pool.next(pool.submit(3))
        with pytest.raises(ValueError, match="no 4"):
            pool.next(pool.submit(4))
    finally:
        pool.close()


def test_a_silent_worker_deaf_to_sigterm_is_named_then_killed_and_reaped_within_the_bound(capsys, no_child_left):
    pool = _pool(deaf_and_stuck)
    pid = pool.workers[0].proc.pid
    started = time.monotonic()
    try:
        with pytest.raises(WorkerLost) as lost:
            pool.next(pool.submit("x"))
        took = time.monotonic() - started
        assert 0.8 <= took < 2.0, took
        assert lost.value.silent_s == 0.8 and lost.value.tasks == ["x"] and lost.value.pids == str(pid)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).ppid() != os.getpid()  # killed and reaped
    finally:
        pool.close()
    err = capsys.readouterr().err
    assert f"testing: waiting 0.2 s for pid [{pid}] on ['x']" in err, err  # the line while the wait lasts
    assert err.count("testing: waiting") <= 4, err  # one line per line_s, not one per poll


def test_a_worker_deaf_to_sigterm_is_killed_at_close_within_the_bound_and_said(capsys, no_child_left):
    pool = _pool(deaf_and_stuck)
    pool.submit("x")
    time.sleep(0.2)  # running its task
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 1.5
    assert "testing: test worker pid " in capsys.readouterr().err


def test_a_worker_that_dies_is_named_with_its_signal_and_the_others_go_on(no_child_left):
    pool = _pool(dies_unless_one, processes=2)
    try:
        keys = [pool.submit(x) for x in range(6)]  # x=1 goes to the second worker, with 3 and 5
        dead = pool.workers[1].proc.pid
        with pytest.raises(WorkerLost) as lost:
            pool.next(keys[1])
        assert lost.value.workers == [(dead, -signal.SIGKILL)] and lost.value.silent_s is None
        assert lost.value.how() == f"pid {dead}, killed by SIGKILL" and lost.value.tasks == [1, 3, 5]
        assert pool.next(pool.submit(7)) == (7, 49)  # the live worker takes the next task
        assert pool.next(keys[4]) == (4, 16)
    finally:
        pool.close()


def test_an_exit_code_is_named_too(no_child_left):
    pool = _pool(dies)
    try:
        with pytest.raises(WorkerLost) as lost:
            pool.next(pool.submit(9))
        assert lost.value.statuses() == "exit code 9"
    finally:
        pool.close()


def test_the_exit_status_is_waited_for_after_the_pipe_closes_within_a_bound(no_child_left):
    pool = _pool(_closes_its_answers_pipe)
    try:
        ino = os.fstat(pool.workers[0].answers_fd).st_ino
        with pytest.raises(WorkerLost) as lost:
            pool.next(pool.submit((ino, "die")))
        assert lost.value.statuses() == "killed by SIGKILL"  # (read at once: not yet readable)
    finally:
        pool.close()
    pool = _pool(_closes_its_answers_pipe)
    try:
        ino = os.fstat(pool.workers[0].answers_fd).st_ino
        started = time.monotonic()
        with pytest.raises(WorkerLost) as lost:  # never ends by itself: killed after exit_wait_s, no status
            pool.next(pool.submit((ino, "live on")))
        assert time.monotonic() - started < 2.0
        assert lost.value.statuses() == "exit status not readable"
    finally:
        pool.close()


def stuck_on_z(x):
    return deaf_and_stuck(x) if x == "z" else x


def test_close_kills_only_the_stuck_worker_its_siblings_hold_no_pipe_of_the_others_open(capsys, no_child_left):
    """Each worker closes the pool's ends of its elder siblings' pipes: else the youngest, stuck, kept them from
    seeing their end, and close() killed them all after reap_s."""
    pool = _pool(stuck_on_z, processes=3)
    keys = [pool.submit(x) for x in "xyz"]
    assert [pool.next(k)[1] for k in keys[:2]] == ["x", "y"]
    stuck = pool.workers[2].proc.pid
    pool.close()
    lines = [line for line in capsys.readouterr().err.splitlines() if "did not end" in line]
    assert lines == [f"testing: test worker pid {stuck} did not end 0.5 s after it was told to stop; killed"], lines
