"""No fault leaves a run hanging (issue 43): real runs, real faults (tests/fault_cases.py says which and how).

Each case asserts what a user would check after the fault: the run ended by itself within its bound, status failed
with the cause named in result.json, no traceback on the console, no process of the run left, and the checkpoint
before the fault still verifies.

CI runs a representative subset (each a tiny model for a few steps): the hang that started the issue (a data file
emptied under data=iterable with DataLoader workers), a worker killed as the OOM killer does under two ranks, and
the launching process killed (its DataLoader workers must notice; then the same command must resume exactly: the
same sample ids and losses as the killed session, from its newest checkpoint). The whole matrix (every case also
resumed, and a store stalled behind a proxy in front of the local S3 server) runs with
DSRECIPES_FAULT_MATRIX=1 (marker `fault_matrix`); `python scripts/fault_matrix.py` prints it as a table (case,
seconds to exit, processes left).
"""

from __future__ import annotations

import os

import pytest

from tests.fault_cases import Case, Store, all_cases, problems, run_case

pytestmark = pytest.mark.slow

CI = [
    Case("iterable", 2, 1, "file_changed"),
    Case("iterable", 2, 2, "worker_killed"),
    Case("map", 2, 1, "launcher_killed"),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fault_cache")


RESUMED_IN_CI = Case("map", 2, 1, "launcher_killed")


@pytest.fixture(scope="module")
def store(s3_server):
    store = Store(s3_server)
    yield store
    store.stop()


@pytest.mark.parametrize("case", CI, ids=lambda c: c.name)
def test_fault_ends_the_run_with_its_cause(case, tmp_path, cache):
    outcome = run_case(case, tmp_path / case.name, cache, resume=case == RESUMED_IN_CI)
    assert not problems(outcome), (problems(outcome), outcome.console[-3000:])
    if case == RESUMED_IN_CI:
        assert outcome.resumed is not None and outcome.resumed.first_step == outcome.resumed.from_step + 1


@pytest.mark.fault_matrix
@pytest.mark.skipif(not os.environ.get("DSRECIPES_FAULT_MATRIX"), reason="the full matrix: DSRECIPES_FAULT_MATRIX=1")
@pytest.mark.parametrize("case", [c for c in all_cases() if c not in CI], ids=lambda c: c.name)
def test_fault_matrix(case, tmp_path, cache, request):
    store = request.getfixturevalue("store") if case.fault == "store_stalled" else None
    outcome = run_case(case, tmp_path / case.name, cache, store=store, resume=True)
    assert not problems(outcome), (problems(outcome), outcome.console[-3000:])


def test_one_line_cause_of_a_worker_error():
    """torch re-raises a worker's exception with the worker's whole traceback as its message: one line remains."""
    from dsrecipes.core.errors import DataError
    from dsrecipes.core.failure import one_line, unwrapped

    text = ("Caught IndexError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
            '  File "/x/dsrecipes/data/stream/reader.py", line 96, in items\n    f, loc, raw = rows[local]\n'
            "                  ~~~~^^^^^^^\nIndexError: list index out of range\n")
    assert one_line(IndexError(text)) == ("IndexError in DataLoader worker 1: list index out of range "
                                          "(at /x/dsrecipes/data/stream/reader.py:96)")
    wrapped = DataError(text.replace("IndexError", "DataError").replace(
        "DataError: list index out of range", "dsrecipes.core.errors.DataError: a.jsonl: changed since"))
    clean = unwrapped(wrapped)
    assert isinstance(clean, DataError) and str(clean) == "a.jsonl: changed since"
    assert one_line(wrapped) == "a.jsonl: changed since"


def test_a_store_that_stops_answering_fails_within_the_read_deadline(monkeypatch, capsys):
    """A server that accepts the connection and never answers (a stalled store): every attempt ends on its own
    timeout, a line per retry names object, bytes and endpoint, and the read fails within data.read_deadline_s
    with one DataError naming both (before: botocore, s3fs and RangeReader retried in silence for ~15 minutes)."""
    import time

    from dsrecipes.core.errors import DataError
    from dsrecipes.data.sources import remote
    from tests.fault_cases import silent_server

    with silent_server() as endpoint:
        for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        remote.configure(8)
        try:
            started = time.monotonic()
            with pytest.raises(DataError) as caught:
                remote.RangeReader("s3://bucket/stalled.jsonl", "s3-x", "etag\x1f").read(0, 100)
            took = time.monotonic() - started
        finally:
            remote.configure(remote.DEFAULT_READ_DEADLINE_S)
    message = str(caught.value)
    assert took <= 8 + 1, took
    assert message.startswith("s3://bucket/stalled.jsonl: bytes 0-100 unreadable after ") and endpoint in message
    assert "data.read_deadline_s=8" in message
    retries = [x for x in capsys.readouterr().err.splitlines() if "attempt" in x]
    assert retries and all("s3://bucket/stalled.jsonl" in x and endpoint in x for x in retries)
