"""The preparation's worker processes (batch_encode.py, `data.preprocess_workers` > 1), every wait bounded.

Forked workers over pipes (core/worker_pool.py). A worker silent WAIT_LINE_S on a chunk is named on the console
while the wait lasts; one silent CHUNK_TIMEOUT_S, or one that dies (the out-of-memory killer's SIGKILL), ends the
preparation with one message naming it (pid, exit code or signal) and the way out; closing lets running chunks
finish, waits REAP_S for the workers, then kills those left.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

from dsrecipes.core.errors import UserError
from dsrecipes.core.worker_pool import WorkerLost, WorkerPool

CHUNK_TIMEOUT_S = 600.0  # one chunk (<= CHUNK rows, <= CHUNK_BYTES) takes seconds; a worker this silent is stuck
WAIT_LINE_S = 30.0  # a chunk awaited this long is named on the console while the wait lasts
REAP_S = 10.0  # a worker's own exit once the pool is closed (a running chunk finishes), before it is killed
DEATH_NOTICE_S = 2.0  # how long the message waits for the dead worker's exit status (its pipe closes first)


class PreparationPool:
    """`workers` processes running `fn(task)` after `init(*init_args)`; see the module comment."""

    def __init__(self, workers: int, fn: Callable[[Any], Any], init: Callable[..., None], init_args: Sequence[Any]):
        self.workers = workers
        self.pool = WorkerPool(workers, fn, label="preparing data", name="preparation worker", waiting=_waiting,
                               line_s=WAIT_LINE_S, bound_s=CHUNK_TIMEOUT_S, reap_s=REAP_S,
                               exit_wait_s=DEATH_NOTICE_S, init=init, init_args=init_args)

    def submit(self, task: Any) -> int:
        try:
            return self.pool.submit(task)
        except WorkerLost as lost:
            raise UserError(lost_message(lost, self.workers)) from None

    def take(self, task: Any, key: int) -> Any:
        """The answer to `task` (submitted as `key`); a worker lost meanwhile ends the preparation."""
        try:
            return self.pool.next(key)[1]
        except WorkerLost as lost:
            raise UserError(lost_message(lost, self.workers)) from None

    def close(self) -> None:
        self.pool.close()


def lost_message(lost: WorkerLost, workers: int) -> str:
    """One message for a worker lost (silent or dead), naming it and the way out."""
    setting = f"data.preprocess_workers={workers}"
    if lost.silent_s is not None:
        return (f"{setting}: no preparation worker answered for {lost.silent_s:g} s on {_what(lost.tasks[0])} "
                f"(worker pid {lost.pids}); the workers were stopped. A worker this slow is stuck: run again with "
                "data.preprocess_workers=1 to prepare in this process")
    how = f" ({lost.how()})" if any(code is not None for _, code in lost.workers) else ""
    return (f"{setting}: a preparation worker process ended without an answer{how}; the out-of-memory killer ends "
            "one this way: lower data.preprocess_workers, or dataset.max_row_bytes")


def _what(task: Any) -> str:
    return f"a chunk of {len(task.items)} rows of {task.path}"


def _waiting(silent_s: float, pids: List[int], tasks: List[Any]) -> str:
    return f"preparing data: waiting {silent_s:.0f} s for {_what(tasks[0])} (worker pid {', '.join(map(str, pids))})"
