"""`validate --all` composes in forked workers; a worker that never answers (a fork taken while another thread held a
lock: the full suite once hung 300 s in `validate --all`, and stop 55's CI 600 s with no line printed) is not waited
on: after CHUNK_TIMEOUT_S its chunks are composed in the parent, with a line that says so, and every answer is still
there. A worker stuck in C never runs the SIGTERM handler it inherited (stopping.raising): it is killed, not joined
for ever as multiprocessing.Pool's terminate() did; a worker that dies has its chunks composed here; no worker is
left behind. The workers are core/worker_pool.py's (its own tests: tests/test_worker_pool.py)."""

import os
import signal
import time

import psutil
import pytest

from dsrecipes.commands import validate
from tests.fault_cases import outcome_within

PARENT = [0]


def _answer(chunk):
    return [(None, [f"composed {' '.join(job)}"], []) for job in chunk]


def stuck_in_workers(chunk):
    if os.getpid() != PARENT[0]:  # a forked worker: stuck
        time.sleep(3600)
    return _answer(chunk)


def stuck_deaf_to_sigterm(chunk):
    """Stuck in C: SIGTERM has no effect (its Python handler never runs); ends by itself after 20 s, so that even
    the old code's wait does not outlive the test."""
    if os.getpid() != PARENT[0] and ["x=1"] in chunk:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(20)
        os._exit(0)
    return _answer(chunk)


def dies_in_one_worker(chunk):
    if os.getpid() != PARENT[0] and ["x=1"] in chunk:
        os._exit(9)
    return _answer(chunk)


@pytest.fixture
def two_cores(monkeypatch):
    PARENT[0] = os.getpid()
    monkeypatch.setattr(validate.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    return [[f"x={i}"] for i in range(20)]


def _children():
    return {c.pid for c in psutil.Process().children() if c.status() != psutil.STATUS_ZOMBIE}


def test_a_stuck_compose_worker_is_not_waited_on(monkeypatch, capsys, two_cores):
    jobs = two_cores
    monkeypatch.setattr(validate, "_compose_chunk", stuck_in_workers)
    monkeypatch.setattr(validate, "CHUNK_TIMEOUT_S", 1.0)
    started = time.monotonic()
    out = validate._compose_parallel(jobs, validate.Progress(len(jobs)))
    assert time.monotonic() - started < 30
    assert sorted(out) == sorted(tuple(j) for j in jobs)
    assert out[("x=3",)][1] == ["composed x=3"]
    assert "a compose worker gave no answer in 1 s" in capsys.readouterr().err


def test_a_worker_deaf_to_sigterm_is_killed_with_a_line_while_it_lasts(monkeypatch, capsys, two_cores):
    jobs = two_cores
    monkeypatch.setattr(validate, "_compose_chunk", stuck_deaf_to_sigterm)
    monkeypatch.setattr(validate, "CHUNK_TIMEOUT_S", 1.5)
    monkeypatch.setattr(validate, "WAIT_LINE_S", 0.5)
    before = _children()
    outcome, took = outcome_within(lambda: validate._compose_parallel(jobs, validate.Progress(len(jobs))), 15)
    assert took < 10, took  # (old code, multiprocessing.Pool: terminate() joined the deaf worker for 20 s)
    assert sorted(outcome) == sorted(tuple(j) for j in jobs)
    err = capsys.readouterr().err
    assert "validate --all: waiting for compose worker pid " in err, err
    assert "a compose worker gave no answer in 1.5 s (pid " in err, err
    assert not _children() - before


def test_a_dead_worker_has_its_chunks_composed_here(monkeypatch, capsys, two_cores):
    jobs = two_cores
    monkeypatch.setattr(validate, "_compose_chunk", dies_in_one_worker)
    before = _children()
    outcome, took = outcome_within(lambda: validate._compose_parallel(jobs, validate.Progress(len(jobs))), 15)
    assert took < 10, took
    assert sorted(outcome) == sorted(tuple(j) for j in jobs)
    assert "ended (exit code 9) before its last" in capsys.readouterr().err
    assert not _children() - before


def test_a_long_validate_all_says_how_far_it_is_when_piped(monkeypatch, capsys, two_cores):
    """`validate --all EXTRA` composes every combination with Hydra (~1.5 min on 2 cores) and, piped, printed
    nothing until the end."""
    jobs = two_cores
    monkeypatch.setattr(validate, "_compose_chunk", lambda chunk: (time.sleep(0.05), _answer(chunk))[1])
    monkeypatch.setattr(validate.Progress, "PIPED_LINE_S", 0.1)
    validate._compose_parallel(jobs, validate.Progress(len(jobs)))
    assert "compositions checked" in capsys.readouterr().err  # (capsys: not a terminal)
