"""Read-ahead of one reader's byte ranges in an object store: few large ranged GETs, overlapped with consumption.

A `data=iterable` reader knows, window by window, which blocks it will ask for and in what order (stream/reader.py).
`ReadAhead` is handed that plan lazily, as (key, file, start, stop) tickets in the order they will be taken, and
keeps the next `budget` bytes of it fetched or in flight:

- a refill takes tickets from the plan until the bytes held (fetched or in flight, not yet taken) reach `budget`;
  it starts again when a take brings them down to half of it, so each refill has half a budget of tickets to group;
- a refill's tickets of one object whose byte ranges touch are fetched by ONE ranged GET (a span), up to
  `span_bytes`; a span never covers a byte no ticket asked for, so grouping changes the number of GETs, not the bytes
  transferred. The plan's first `FIRST_TICKETS` tickets (a first micro-batch's blocks) are drawn alone and fetched
  one GET each; the rest of the plan is drawn only when they have all been taken (or a block past them is asked):
  drawing a 64 MiB budget (hundreds of tickets from dozens of windows) took the reader's interpreter from the
  building of its S3 client before the first batch (R = 1 first batch under load ~15: 1.14-1.28 s drawing it first,
  see docs/scale.md for the after). A reader in a DataLoader worker draws it while the trainer runs its first step;
  one in the trainer's process (`num_workers=0`) when the second micro-batch is asked. Spans are handed to the
  threads only once the first tickets are in: the first batch waits for its own blocks, not for a span of
  megabytes, neither sharing the bandwidth with one nor the interpreter with the start of a dozen fetching threads
  (measured, 256 MiB corpus through the local S3 server: time to first batch 3.7 s with the spans in flight beside
  the first blocks, 0.6-0.9 s with them waiting on threads of their own);
- spans are fetched by `threads` threads in the order of their first ticket; a fetched span is cut into its tickets'
  bytes at once, so memory is the untaken tickets' bytes: <= `budget` plus one ticket (plus one span being cut).

`read(file, start, stop)` does the GET (`RangePool` below, one remote.RangeReader per object and thread: If-Match on
the indexed ETag, retries with backoff; a span whose connection drops mid-body is retried whole, and its bytes count
once). A failed span raises its error at the
take of any of its tickets. `take(key)` returns None for a key the plan does not hold (the caller reads it itself).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Deque, Dict, Hashable, Iterator, List, Optional, Set, Tuple

from dsrecipes.data.sources.remote import PREFETCH_THREADS, RangeReader

Ticket = Tuple[Hashable, int, int, int]  # (key, file, start, stop)
FIRST_TICKETS = 4  # the plan's first tickets, fetched one GET each before the spans


class ReadAhead:
    def __init__(self, plan: Iterator[Ticket], read: Callable[[int, int, int], bytes], *, budget: int,
                 span_bytes: int, threads: int):
        self._plan: Optional[Iterator[Ticket]] = plan
        self._read = read
        self.budget, self.span_bytes = max(1, int(budget)), max(1, int(span_bytes))
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="dsrecipes-ahead")
        self._untaken: Dict[Hashable, Deque[Tuple[Future, int, int]]] = {}  # key -> (span, piece, size), in order
        self.held = 0  # bytes of tickets planned and not yet taken (fetched or in flight)
        self.peak = 0  # the most `held` ever was (tests, benchmarks)
        self.gets = 0  # spans fetched
        self.bytes = 0  # bytes fetched (each span once, whatever its retries)
        self._singles = FIRST_TICKETS  # the plan's first tickets still to fetch singly
        self._lock = threading.Lock()
        self._singles_left = 0  # first tickets fetched singly and not in yet
        self._deferred: Optional[List[Tuple[Future, tuple]]] = []  # spans held back until they are (None: none)
        self._firsts: Set[Future] = set()  # the first tickets' GETs whose ticket is not taken yet
        self._lazy = True  # only the first tickets drawn: the rest of the plan once they are taken
        self._refill(firsts_only=True)
        if not self._singles_left:
            self._release()

    def take(self, key: Hashable) -> Optional[bytes]:
        """The bytes of `key`'s next ticket (waiting for its span), or None when the plan holds no ticket for it."""
        if self._lazy and (not self._firsts or key not in self._untaken):  # the first tickets handed out, or a
            self._lazy = False  # block past them asked: the rest of the plan is drawn now
            self._refill()
        pieces = self._untaken.get(key)
        if not pieces:
            return None
        span, piece, size = pieces.popleft()
        self._firsts.discard(span)
        if not pieces:
            del self._untaken[key]
        self.held -= size
        try:
            parts = span.result()
            data, parts[piece] = parts[piece], b""  # the taken ticket's bytes are the caller's now
        finally:
            if not self._lazy and self.held <= self.budget // 2:
                self._refill()
        return data

    def _refill(self, firsts_only: bool = False) -> None:
        """Take tickets from the plan up to `budget` bytes held (`firsts_only`: the first tickets), group them into
        spans, start the spans."""
        fresh: List[Tuple[int, Ticket]] = []
        while self._plan is not None and self.held < self.budget and not (firsts_only and not self._singles):
            ticket = next(self._plan, None)
            if ticket is None:
                self._plan = None
                break
            self.held += ticket[3] - ticket[2]
            if self._singles:  # one of the plan's first tickets: its GET starts now, before the rest is planned
                self._singles -= 1
                with self._lock:
                    self._singles_left += 1
                self._start([ticket], first=True)
            else:
                fresh.append((len(fresh), ticket))
        self._singles = 0
        self.peak = max(self.peak, self.held)
        for span in sorted(self._spans(fresh), key=lambda s: min(order for order, _ in s)):  # by need
            self._start([t for _, t in span])

    def _spans(self, fresh: List[Tuple[int, Ticket]]) -> List[List[Tuple[int, Ticket]]]:
        """`fresh` tickets grouped: touching ranges of one object, in byte order, at most the span cap each."""
        spans: List[List[Tuple[int, Ticket]]] = []
        for order, ticket in sorted(fresh, key=lambda x: (x[1][1], x[1][2], x[0])):
            last = spans[-1][-1][1] if spans else None
            if (last is not None and last[1] == ticket[1] and last[3] == ticket[2]
                    and ticket[3] - spans[-1][0][1][2] <= self.span_bytes):
                spans[-1].append((order, ticket))
            else:
                spans.append([(order, ticket)])
        return spans

    def _start(self, tickets: List[Ticket], first: bool = False) -> None:
        _, f, start, _ = tickets[0]
        stop = tickets[-1][3]
        cuts = [(t[2] - start, t[3] - start) for t in tickets]
        with self._lock:
            held_back = not first and self._deferred is not None
            span: Future = Future()
            if held_back:
                self._deferred.append((span, (f, start, stop, cuts)))
        if not held_back:
            span = self._pool.submit(self._fetch_first if first else self._fetch, f, start, stop, cuts)
            if first:
                self._firsts.add(span)
        for i, (key, _, a, b) in enumerate(tickets):
            self._untaken.setdefault(key, deque()).append((span, i, b - a))

    def _fetch_first(self, f: int, start: int, stop: int, cuts: List[Tuple[int, int]]) -> List[bytes]:
        try:
            return self._fetch(f, start, stop, cuts)
        finally:  # in or failed (each read ends within data.read_deadline_s): the held-back spans may start
            with self._lock:
                self._singles_left -= 1
                last = not self._singles_left
            if last:
                self._release()

    def _release(self) -> None:
        """Hand the held-back spans to the threads; each one's result reaches the future its tickets wait on."""
        with self._lock:
            deferred, self._deferred = self._deferred or [], None
        for placeholder, args in deferred:
            try:
                real = self._pool.submit(self._fetch, *args)
            except RuntimeError as exc:  # closed meanwhile
                placeholder.set_exception(exc)
                continue
            real.add_done_callback(lambda done, p=placeholder: _forward(done, p))

    def _fetch(self, f: int, start: int, stop: int, cuts: List[Tuple[int, int]]) -> List[bytes]:
        data = self._read(f, start, stop)
        with self._lock:
            self.gets += 1
            self.bytes += len(data)
        return [data[a:b] for a, b in cuts]

    def close(self) -> None:
        self._plan = None
        with self._lock:
            deferred, self._deferred = self._deferred or [], None
        for placeholder, _ in deferred:
            placeholder.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._untaken.clear()
        self.held = 0


class RangePool:
    """Ranged reads from several threads (the read-ahead's, remote_ahead.py): one RangeReader per object and
    thread; `retries` counts the faults all of them survived."""

    def __init__(self, threads: int = PREFETCH_THREADS):
        self.threads = threads
        self._local = threading.local()
        self._all: List[RangeReader] = []
        self._lock = threading.Lock()

    def read(self, url: str, digest: str, etag: str, start: int, stop: int) -> bytes:
        readers = self._local.__dict__.setdefault("readers", {})
        if url not in readers:
            readers[url] = RangeReader(url, digest, etag)
            with self._lock:
                self._all.append(readers[url])
        return readers[url].read(start, stop)

    @property
    def retries(self) -> int:
        with self._lock:
            return sum(r.retries for r in self._all)

    def close(self) -> None:
        with self._lock:
            for reader in self._all:
                reader.close()
            self._all.clear()
        self._local = threading.local()


def _forward(done: Future, placeholder: Future) -> None:
    if done.cancelled():
        placeholder.cancel()
    elif done.exception() is not None:
        placeholder.set_exception(done.exception())
    else:
        placeholder.set_result(done.result())
