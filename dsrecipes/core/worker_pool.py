"""Forked worker processes, each with a pipe of its own each way, and no wait on them without a bound.

`validate --all` (Hydra composes) and the data preparation (tokenization, `data.preprocess_workers`) hand tasks to
forked processes, both through this module (they had one mechanism each). Not multiprocessing.Pool, whose
terminate() sends SIGTERM and joins without a bound, nor concurrent.futures, whose shutdown(wait=True) joins without
one: a forked worker stuck in C (a lock taken at fork time) never runs the Python SIGTERM handler it inherits
(core/stopping.py `raising`), and the launching process waited for ever, in silence. Here:

- the launching process only ever waits in `next()`, polling its pipes: a worker with tasks that has sent nothing
  for `line_s` is named on the console (the user's `waiting` line) every `line_s` while the wait lasts, and one
  silent for `bound_s` is killed (SIGKILL), reaped and raised as WorkerLost with its unanswered tasks;
- a worker whose pipe closes with tasks unanswered (the out-of-memory killer's SIGKILL, an exit) is raised as
  WorkerLost with its pid and exit code or signal, read within `exit_wait_s` (the kernel closes the pipe first);
- what happens to a lost worker's tasks is the user's choice: done again in the launching process (validate) or one
  message that ends the run (preparation); the other workers go on;
- `close()` closes the pipes (a running task finishes, its answer goes nowhere, queued ones are never started),
  waits `reap_s` for all the workers, then kills and reaps those left, with a line: no process outlives the pool.

Tasks go down through non-blocking writes, answers come up through non-blocking reads (8-byte length, pickle), so
a worker that stops mid-message cannot hold the launching process either. A task's exception comes back and is
raised by `next()`.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import pickle
import select
import signal
import struct
import sys
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

HEADER = struct.Struct("!Q")
PIPE_BYTES = 1 << 20  # a task (the preparation's: up to 8 MiB of rows) goes down in few writes where Linux allows
READ_BYTES = 1 << 20
Waiting = Callable[[float, List[int], List[Any]], str]  # (silent s, pids, their current tasks) -> the console line


class WorkerLost(Exception):
    """Workers that ended (`silent_s` None) or gave no answer for `silent_s` with tasks unanswered: killed and
    reaped; `tasks` are theirs, unanswered, in the order they were submitted."""

    def __init__(self, workers: List[Tuple[int, Optional[int]]], tasks: List[Any], silent_s: Optional[float]):
        super().__init__(f"worker pid {', '.join(str(pid) for pid, _ in workers)} lost")
        self.workers, self.tasks, self.silent_s = workers, tasks, silent_s

    @property
    def pids(self) -> str:
        return ", ".join(str(pid) for pid, _ in self.workers)

    def how(self) -> str:
        """'pid 12, killed by SIGKILL' / 'pid 12, exit code 9' / 'pid 12' (status not readable), per worker."""
        return "; ".join(f"pid {pid}" + (f", {ended_how(code)}" if code is not None else "")
                         for pid, code in self.workers)

    def statuses(self) -> str:
        """'exit code 9' / 'killed by SIGKILL' / 'exit status not readable', per worker."""
        return "; ".join(ended_how(code) for _, code in self.workers)


def ended_how(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "exit status not readable"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class _Worker:
    def __init__(self, proc: Any, tasks_fd: int, answers_fd: int):
        self.proc, self.tasks_fd, self.answers_fd = proc, tasks_fd, answers_fd
        self.outbox: Deque[memoryview] = deque()
        self.inbox = bytearray()
        self.todo: Dict[int, Any] = {}  # seq -> task, submitted and not answered, in order
        self.since = 0.0  # when it last sent bytes, or was given work while idle: its silence starts there
        self.ended = False  # its answers pipe closed


class WorkerPool:
    """`processes` forked workers that run `fn(task)`; see the module comment."""

    def __init__(self, processes: int, fn: Callable[[Any], Any], *, label: str, name: str, waiting: Waiting,
                 line_s: float, bound_s: float, reap_s: float, exit_wait_s: float = 2.0,
                 init: Optional[Callable[..., None]] = None, init_args: Sequence[Any] = ()):
        self.label, self.name, self.waiting = label, name, waiting
        self.line_s, self.bound_s, self.reap_s, self.exit_wait_s = line_s, bound_s, reap_s, exit_wait_s
        self.workers: List[_Worker] = []
        self.ready: Dict[int, Tuple[Any, bool, Any]] = {}  # seq -> (task, ok, answer or exception)
        self.seq = 0
        self.said_at = -float("inf")  # when the last waiting line was printed
        self.poll = select.poll()
        try:
            for _ in range(processes):
                self.workers.append(self._start(fn, init, tuple(init_args)))
        except BaseException:  # e.g. fork refused (EAGAIN): the ones started are not left behind
            self.close()
            raise
        self.by_fd = {fd: w for w in self.workers for fd in (w.tasks_fd, w.answers_fd)}
        for w in self.workers:
            self.poll.register(w.answers_fd, select.POLLIN)

    def _start(self, fn: Callable[[Any], Any], init: Optional[Callable[..., None]],
               init_args: Tuple[Any, ...]) -> _Worker:
        down, up = os.pipe(), os.pipe()
        theirs = [fd for w in self.workers for fd in (w.tasks_fd, w.answers_fd)] + [down[1], up[0]]
        proc = mp.get_context("fork").Process(target=_serve, args=(down[0], up[1], fn, init, init_args, theirs),
                                              daemon=True)
        try:
            proc.start()
        except BaseException:
            for fd in (*down, *up):
                os.close(fd)
            raise
        os.close(down[0])
        os.close(up[1])
        for fd in (down[1], up[0]):
            os.set_blocking(fd, False)
            _grow(fd)
        return _Worker(proc, down[1], up[0])

    @property
    def pending(self) -> int:
        """Tasks submitted and not yet returned by `next()` (lost ones excepted)."""
        return len(self.ready) + sum(len(w.todo) for w in self.workers)

    def submit(self, task: Any) -> int:
        """Hands `task` to the live worker with the fewest unanswered tasks; its key for `next()`."""
        live = [w for w in self.workers if not w.ended]
        if not live:
            raise WorkerLost([(w.proc.pid, w.proc.exitcode) for w in self.workers], [task], None)
        worker = min(live, key=lambda w: len(w.todo))
        self.seq += 1
        if not worker.todo:
            worker.since = time.monotonic()
        worker.todo[self.seq] = task
        data = pickle.dumps((self.seq, task), pickle.HIGHEST_PROTOCOL)
        worker.outbox.append(memoryview(HEADER.pack(len(data)) + data))
        self._send(worker)
        return self.seq

    def next(self, key: Optional[int] = None) -> Tuple[Any, Any]:
        """(task, answer) of `key`, or of the first answered task; raises the task's exception, or WorkerLost."""
        while True:
            seq = key if key is not None else next(iter(self.ready), None)
            if seq in self.ready:
                task, ok, answer = self.ready.pop(seq)
                if not ok:
                    raise answer
                return task, answer
            if not any(w.todo if key is None else key in w.todo for w in self.workers):
                raise KeyError(f"{self.name}: no task {key} outstanding")  # returned already, or lost
            self._pump(self._due())
            self._check()

    def _due(self) -> float:
        """Seconds until a busy worker's silence is due a line or reaches the bound."""
        now = time.monotonic()
        busy = [now - w.since for w in self.workers if w.todo and not w.ended]
        if not busy:
            return 0.0
        next_line = max(self.said_at + self.line_s - now, self.line_s - max(busy))
        return max(0.0, min(next_line, self.bound_s - max(busy)))

    def _pump(self, timeout_s: float) -> None:
        for fd, event in self.poll.poll(timeout_s * 1000):
            worker = self.by_fd[fd]
            if fd == worker.tasks_fd:
                self._send(worker)
            else:
                self._receive(worker)

    def _send(self, worker: _Worker) -> None:
        try:
            while worker.outbox:
                view = worker.outbox[0]
                n = os.write(worker.tasks_fd, view)
                if n < len(view):
                    worker.outbox[0] = view[n:]
                    break
                worker.outbox.popleft()
        except BlockingIOError:
            pass
        except OSError:  # its end is closed: it ended (its answers pipe says so)
            worker.outbox.clear()
        if worker.outbox:
            self.poll.register(worker.tasks_fd, select.POLLOUT)
        else:
            self._forget(worker.tasks_fd)

    def _forget(self, fd: int) -> None:
        try:
            self.poll.unregister(fd)
        except KeyError:
            pass

    def _receive(self, worker: _Worker) -> None:
        try:
            data = os.read(worker.answers_fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            worker.ended = True
            self._forget(worker.answers_fd)
            self._forget(worker.tasks_fd)
            return
        worker.inbox += data
        worker.since = time.monotonic()  # a part of an answer is a sign of life too (a large one takes many reads)
        while len(worker.inbox) >= HEADER.size:
            (n,) = HEADER.unpack_from(worker.inbox)
            if len(worker.inbox) < HEADER.size + n:
                break
            with memoryview(worker.inbox) as view:
                seq, ok, answer = pickle.loads(view[HEADER.size: HEADER.size + n])
            del worker.inbox[: HEADER.size + n]
            self.ready[seq] = (worker.todo.pop(seq), ok, answer)

    def _check(self) -> None:
        """Raises WorkerLost for workers ended or silent past the bound; prints the waiting line when due."""
        now = time.monotonic()
        ended = [w for w in self.workers if w.ended and w.todo]
        if ended:
            for w in ended:
                w.proc.join(self.exit_wait_s)  # its exit status, a moment after its pipe closed
            raise self._lose(ended, None)
        stuck = [w for w in self.workers if w.todo and not w.ended and now - w.since >= self.bound_s]
        if stuck:
            for w in stuck:
                w.proc.kill()
            raise self._lose(stuck, self.bound_s)
        silent = [w for w in self.workers if w.todo and not w.ended and now - w.since >= self.line_s]
        longest = max((now - w.since for w in silent), default=0.0)
        if silent and now - self.said_at >= self.line_s:
            self.said_at = now
            line = self.waiting(longest, [w.proc.pid for w in silent], [next(iter(w.todo.values())) for w in silent])
            print(line, file=sys.stderr, flush=True)

    def _lose(self, workers: List[_Worker], silent_s: Optional[float]) -> WorkerLost:
        codes = []
        for w in workers:
            status = w.proc.exitcode
            if w.proc.exitcode is None:  # pipe closed but still running, or just killed
                w.proc.kill()
            w.proc.join(self.reap_s)
            codes.append((w.proc.pid, status if silent_s is None else None))
            self._end(w)
        tasks = [t for w in workers for t in w.todo.values()]
        for w in workers:
            w.todo.clear()
        return WorkerLost(codes, tasks, silent_s)

    def _end(self, worker: _Worker) -> None:
        worker.ended = True
        for fd in (worker.tasks_fd, worker.answers_fd):
            if fd >= 0:
                self._forget(fd)
                os.close(fd)
        worker.tasks_fd = worker.answers_fd = -1
        worker.outbox.clear()

    def close(self) -> None:
        """Pipes closed, so every worker ends after its running task; one still there after `reap_s` is killed,
        and said. Idempotent."""
        for w in self.workers:
            self._end(w)
        deadline = time.monotonic() + self.reap_s
        for w in self.workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
        left = [w.proc for w in self.workers if w.proc.exitcode is None]
        if left:
            print(f"{self.label}: {self.name} pid {', '.join(str(p.pid) for p in left)} did not end {self.reap_s:g} s "
                  "after it was told to stop; killed", file=sys.stderr, flush=True)
            for proc in left:
                proc.kill()
            for proc in left:
                proc.join(self.reap_s)


def _grow(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):  # not Linux, or past the user's pipe quota: the default size works too
        pass


def _serve(tasks_fd: int, answers_fd: int, fn: Callable[[Any], Any], init: Optional[Callable[..., None]],
           init_args: Tuple[Any, ...], theirs: List[int]) -> None:
    """The worker: its siblings' and the pool's ends closed (else a sibling's copy keeps a pipe open), then task by
    task until its pipe ends or its answer has nowhere to go."""
    for fd in theirs:
        os.close(fd)
    if init is not None:
        init(*init_args)
    while True:
        frame = _read_frame(tasks_fd)
        if frame is None:
            return
        seq, task = pickle.loads(frame)
        try:
            answer = (seq, True, fn(task))
        except Exception as exc:  # noqa: BLE001 - raised again by the launching process's next()
            answer = (seq, False, exc)
        try:
            data = pickle.dumps(answer, pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an answer or exception that does not pickle: said as such
            data = pickle.dumps((seq, False, RuntimeError(f"{type(exc).__name__}: {exc}")), pickle.HIGHEST_PROTOCOL)
        try:
            _write_all(answers_fd, HEADER.pack(len(data)) + data)
        except OSError:  # the pool was closed
            return


def _read_frame(fd: int) -> Optional[bytearray]:
    head = _read_exactly(fd, HEADER.size)
    return None if head is None else _read_exactly(fd, HEADER.unpack(head)[0])


def _read_exactly(fd: int, n: int) -> Optional[bytearray]:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            return None
        got += k
    return buf


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
