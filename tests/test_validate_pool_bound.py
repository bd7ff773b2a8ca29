"""`validate --all` composes in forked workers; a worker that never answers (a fork taken while another thread held a
lock: the full suite once hung 300 s in `validate --all`) is not waited on: after CHUNK_TIMEOUT_S the rest is
composed in the parent, with a line that says so, and every answer is still there."""

import os
import time

from dsrecipes.commands import validate

PARENT = [0]


def stuck_in_workers(chunk):
    if os.getpid() != PARENT[0]:  # a forked worker: stuck
        time.sleep(3600)
    return [(None, [f"composed {' '.join(job)}"], []) for job in chunk]


def test_a_stuck_compose_worker_is_not_waited_on(monkeypatch, capsys):
    PARENT[0] = os.getpid()
    monkeypatch.setattr(validate, "_compose_chunk", stuck_in_workers)
    monkeypatch.setattr(validate, "CHUNK_TIMEOUT_S", 1.0)
    monkeypatch.setattr(validate.os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    jobs = [[f"x={i}"] for i in range(20)]
    started = time.monotonic()
    out = validate._compose_parallel(jobs, validate.Progress(len(jobs)))
    assert time.monotonic() - started < 30
    assert sorted(out) == sorted(tuple(j) for j in jobs)
    assert out[("x=3",)][1] == ["composed x=3"]
    assert "a compose worker gave no answer in 1 s" in capsys.readouterr().err
