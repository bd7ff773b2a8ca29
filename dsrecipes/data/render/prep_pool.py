"""The preparation's worker pool (batch_encode.py, `data.preprocess_workers` > 1) with every wait bounded.

A chunk awaited WAIT_LINE_S is named on the console while the wait lasts; one unanswered after CHUNK_TIMEOUT_S ends
the preparation with one message naming the file and the workers; closing waits REAP_S for each worker, then kills
it. A forked worker stuck in C never runs the Python SIGTERM handler it inherits (core/stopping.py `raising`): the
executor's own shutdown(wait=True) would join it for ever. A worker that dies (the OOM killer's SIGKILL) breaks the
executor at once; `died()` is the message, naming it and its signal.
"""

from __future__ import annotations

import signal
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Dict, Iterable

from dsrecipes.core.errors import UserError

CHUNK_TIMEOUT_S = 600.0  # one chunk (<= CHUNK rows, <= CHUNK_BYTES) takes seconds; a worker this silent is stuck
WAIT_LINE_S = 30.0  # a chunk awaited this long is named on the console while the wait lasts
REAP_S = 10.0  # a worker's own exit once the pool is shut down (a running chunk finishes), before it is killed
DEATH_NOTICE_S = 2.0  # how long the message waits for the dead worker's exit status (it closes its pipe first)


class PreparationPool:
    """`ProcessPoolExecutor` of `workers` processes; see the module comment."""

    def __init__(self, pool: ProcessPoolExecutor, workers: int):
        self.pool, self.workers = pool, workers
        self.seen: Dict[int, Any] = {}  # every worker process met (after its death, its exit code names the cause)

    def submit(self, fn: Callable[[Any], Any], task: Any) -> Future:
        future = self.pool.submit(fn, task)
        self.seen.update(getattr(self.pool, "_processes", None) or {})
        return future

    def take(self, task: Any, future: Future) -> Any:
        """`future`'s result, waited on as the module comment says (`task` names the chunk)."""
        waited = 0.0
        while True:
            step = min(WAIT_LINE_S, CHUNK_TIMEOUT_S - waited)
            try:
                return future.result(timeout=step)
            except FutureTimeout:
                waited += step
            what = f"a chunk of {len(task.items)} rows of {task.path} (worker pid {self._pids()})"
            if waited >= CHUNK_TIMEOUT_S:
                self.kill()
                raise UserError(f"data.preprocess_workers={self.workers}: no preparation worker answered for "
                                f"{CHUNK_TIMEOUT_S:g} s on {what}; the workers were stopped. A worker this slow is "
                                "stuck: run again with data.preprocess_workers=1 to prepare in this process")
            print(f"preparing data: waiting {waited:.0f} s for {what}", file=sys.stderr, flush=True)

    def _pids(self) -> str:
        return ", ".join(str(p.pid) for p in self.seen.values() if p.exitcode is None) or "none alive"

    def kill(self) -> None:
        for proc in self.seen.values():
            if proc.exitcode is None:
                proc.kill()

    def close(self) -> None:
        """Queued chunks cancelled, running ones finish; a worker still there after REAP_S is killed, and said."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + REAP_S
        for proc in self.seen.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        left = [p for p in self.seen.values() if p.exitcode is None]
        if left:
            print(f"preparing data: preparation worker pid {', '.join(str(p.pid) for p in left)} did not end "
                  f"{REAP_S:g} s after the pool was shut down; killed", file=sys.stderr, flush=True)
            self.kill()
            for proc in left:
                proc.join(REAP_S)

    def died(self) -> str:
        return died_message(self.seen.values(), self.workers)


def died_message(procs: Iterable[Any], workers: int) -> str:
    """The message for a preparation worker that ended without an answer: which one and how, where known.

    The pool breaks when the worker's pipe closes, a moment before the kernel makes its exit status readable (under
    load, long enough for `exitcode` to read None): the status is polled for up to DEATH_NOTICE_S."""
    procs = list(procs)
    deadline = time.monotonic() + DEATH_NOTICE_S
    while True:
        dead = [(p.pid, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
        if dead or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    how = ""
    if dead:  # the one that died first, not a sibling the broken pool then ended with SIGTERM
        pid, code = min(dead, key=lambda d: d[1] == -signal.SIGTERM)
        how = f" (pid {pid}, " + (f"killed by {signal.Signals(-code).name})" if code < 0 else f"exit code {code})")
    return (f"data.preprocess_workers={workers}: a preparation worker process ended without an answer{how}; "
            "the out-of-memory killer ends one this way: lower data.preprocess_workers, or dataset.max_row_bytes")
