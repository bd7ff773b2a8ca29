"""A reader's first batch waits only for its own blocks (issue 45: time to first batch against mosaicml-streaming).

The read-ahead fetches the plan's first tickets one GET each and holds every span back until they are in, so the
first micro-batch shares neither the bandwidth nor the interpreter with megabytes of read-ahead; and the read-ahead's
threads share one botocore client, built once however many ask at the same moment."""

from __future__ import annotations

import threading
import time

from dsrecipes.data.sources import remote
from dsrecipes.data.sources.remote_ahead import FIRST_TICKETS, ReadAhead


def test_spans_start_only_after_the_first_blocks_are_in():
    events, lock = [], threading.Lock()

    def read(f, start, stop):
        with lock:
            events.append(("start", start, stop))
        time.sleep(0.05 if stop - start == 10 else 0.0)  # the first blocks are slow to come
        with lock:
            events.append(("end", start, stop))
        return bytes(stop - start)

    plan = iter([(i, 0, 10 * i, 10 * i + 10) for i in range(40)])  # 40 touching blocks of one object
    ahead = ReadAhead(plan, read, budget=400, span_bytes=100, threads=8)
    try:
        for i in range(40):
            assert ahead.take(i) == bytes(10)
    finally:
        ahead.close()
    firsts = {(10 * i, 10 * i + 10) for i in range(FIRST_TICKETS)}
    last_first_end = max(n for n, e in enumerate(events) if e[0] == "end" and e[1:] in firsts)
    span_starts = [n for n, e in enumerate(events) if e[0] == "start" and e[1:] not in firsts]
    assert span_starts and min(span_starts) > last_first_end, events
    assert ahead.gets < 40 - FIRST_TICKETS  # the rest still came in spans


def test_a_closed_read_ahead_cancels_what_it_held_back():
    gate = threading.Event()

    def read(f, start, stop):
        gate.wait(5)
        return bytes(stop - start)

    ahead = ReadAhead(iter([(i, 0, 10 * i, 10 * i + 10) for i in range(20)]), read, budget=200, span_bytes=100,
                      threads=2)
    gate.set()
    ahead.close()  # ends at once: nothing waits for spans that never started


def test_threads_asking_at_once_share_one_client(monkeypatch):
    import botocore.session

    made = []
    real = botocore.session.Session.create_client

    def counting(self, *args, **kwargs):
        made.append(1)
        time.sleep(0.05)  # a slow build: the others ask meanwhile
        return real(self, *args, **kwargs)

    monkeypatch.setattr(botocore.session.Session, "create_client", counting)
    for key, value in {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k",
                       "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    remote._CLIENT.clear()
    clients = []
    threads = [threading.Thread(target=lambda: clients.append(remote.client())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    remote._CLIENT.clear()
    assert len(made) == 1 and len({id(c) for c in clients}) == 1


def test_the_first_gets_start_before_the_rest_of_the_plan_is_drawn():
    """Drawing the plan (a 64 MiB budget: hundreds of tickets, dozens of windows computed) used to come before the
    first GET; the first tickets' GETs now start as soon as they are drawn, while the rest is planned."""
    started = threading.Event()

    def plan():
        for i in range(FIRST_TICKETS):
            yield (i, 0, 10 * i, 10 * i + 10)
        assert started.wait(5), "no GET started while the rest of the plan was drawn"
        for i in range(FIRST_TICKETS, 40):
            yield (i, 0, 10 * i, 10 * i + 10)

    def read(f, start, stop):
        started.set()
        return bytes(stop - start)

    ahead = ReadAhead(plan(), read, budget=400, span_bytes=100, threads=4)
    try:
        assert all(ahead.take(i) == bytes(10) for i in range(40))
    finally:
        ahead.close()


def test_the_rest_of_the_plan_is_drawn_once_the_first_tickets_are_taken():
    """Drawing a 64 MiB budget of plan took the reader's interpreter from its S3 client before the first batch: only
    the first tickets are drawn at the start, the rest when they are all taken (or a block past them is asked)."""
    drawn = []

    def plan(n=40):
        for i in range(n):
            drawn.append(i)
            yield (i, 0, 10 * i, 10 * i + 10)

    def read(f, start, stop):
        return bytes((start + j) % 251 for j in range(stop - start))  # each byte names its place

    ahead = ReadAhead(plan(), read, budget=400, span_bytes=100, threads=4)
    try:
        assert len(drawn) == FIRST_TICKETS
        for i in range(FIRST_TICKETS):
            assert ahead.take(i) == read(0, 10 * i, 10 * i + 10)
        assert len(drawn) == FIRST_TICKETS  # the first batch is out before the rest is planned
        for i in range(FIRST_TICKETS, 40):
            assert ahead.take(i) == read(0, 10 * i, 10 * i + 10)
        assert len(drawn) == 40 and ahead.take(99) is None
    finally:
        ahead.close()
    drawn.clear()
    ahead = ReadAhead(plan(), read, budget=400, span_bytes=100, threads=4)
    try:  # a block past the first tickets asked first: the plan is drawn for it
        k = FIRST_TICKETS + 1
        assert ahead.take(0) == read(0, 0, 10) and ahead.take(k) == read(0, 10 * k, 10 * k + 10)
        assert all(ahead.take(i) == read(0, 10 * i, 10 * i + 10) for i in range(1, FIRST_TICKETS))
    finally:
        ahead.close()
