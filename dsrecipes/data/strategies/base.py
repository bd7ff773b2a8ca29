"""What every strategy's train loader shares: the rank's position in the plan, epochs, and the resume state.

A strategy only says how to produce the remaining micro-batches of an epoch from an `EpochPlan`-like position
(`_batches`); counting, epochs, `state_dict` and elastic resume live here once.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import re
import signal
import time
import weakref
from typing import Any, Dict, Iterator, Optional

import dsrecipes.core.failure as failure
from dsrecipes.core.errors import DataError
from dsrecipes.core.failure import died_by_signal, from_a_dead_peer, unwrapped
from dsrecipes.data.plan.epoch import STATE_VERSION, Layout, Position, resume_point

PR_SET_PDEATHSIG = 1  # linux/prctl.h

Batch = Dict[str, Any]
Row = Dict[str, Any]


def loader_generator(seed: int, epoch: int) -> Any:
    """The DataLoader's own generator: creating a DataLoader iterator draws a seed from the global torch RNG unless
    it has one, which would shift dropout after a resume (the resumed run creates an iterator the original did not
    create at that point). With its own generator the training RNG is left exactly as the checkpoint restored it."""
    import torch

    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def worker_ignores_stop_signals(_worker_id: int) -> None:
    """DataLoader `worker_init_fn`: a SIGTERM/SIGINT sent to the whole process group must stop the rank at a step
    boundary (stopping.py), not kill the worker that feeds it mid-step; workers end with their rank, and never
    outlive it: the kernel SIGKILLs a worker whose rank dies (PR_SET_PDEATHSIG), and a worker whose rank died before
    that was set ends at once. The rank's failure path ends its workers itself (`end_workers`). A worker writing to
    its rank's end of a pipe that is gone (the rank ending) ends at once by SIGPIPE as well: the launching process
    keeps SIGPIPE ignored (cli.main, core/console.OutputClosed), and a rank run in that process (launcher=local, one
    rank) would otherwise hand its workers a BrokenPipeError to linger on."""

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    die_with_parent()


def die_with_parent() -> None:
    """SIGKILL this process when the process that started it dies (Linux; elsewhere: nothing), and exit now if it
    already has (the parent's pid is multiprocessing's record of it, or the one given)."""
    parent = multiprocessing.parent_process()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and parent.pid is not None and os.getppid() != parent.pid:
        os._exit(1)  # the rank is gone already: nothing to feed


_live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # this process's DataLoader iterators that have workers


def iterate(loader: Any) -> Iterator[Any]:
    """`iter(loader)`, with its worker processes known to `end_workers` while it lives. A worker that died of a
    signal (the OOM killer's SIGKILL) is one WorkerLost naming the worker, its signal and what to change."""
    it = iter(loader)
    if not getattr(it, "_workers", None):
        yield from it
        return
    _live.add(it)
    try:
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            except BaseException as exc:
                lost = worker_lost(it, exc) if isinstance(exc, Exception) else None  # before its siblings are killed
                end_workers()  # a worker's exception (re-raised here) or a stop: its siblings go now
                if lost is not None:
                    raise lost from None
                clean = unwrapped(exc)  # a worker's DataError: its own message, not torch's traceback text
                if clean is exc:
                    raise
                raise clean from None
            yield batch
    finally:
        _live.discard(it)


class WorkerLost(RuntimeError):
    """A DataLoader worker of this rank died of a signal (one line: which worker, which signal, what to change)."""

    plain = True  # its message is the whole cause (core/failure.py)


def worker_died(exc: BaseException) -> bool:
    """`exc` says a DataLoader worker of this rank died (torch's 'DataLoader worker (pid ...)', or a WorkerLost): the
    cause is here and named, so there is no peer to wait for (heartbeat.explain_crash's 7 s) before reporting it."""
    return isinstance(exc, WorkerLost) or "DataLoader worker (pid" in str(exc)


def worker_lost(it: Any, exc: BaseException) -> Optional[WorkerLost]:
    """The WorkerLost for a worker that died of a signal: torch's 'DataLoader worker (pid ...) is killed by signal' /
    'exited unexpectedly' (raised by next(it) or by torch's SIGCHLD handler wherever the rank was), or any error of
    the rank while one of its workers lies dead of a signal. After a broken pipe, a connection reset or an EOF (a
    worker killed by SIGKILL closes its end before it can be seen dead) its death is awaited for up to
    core/failure.PEER_DEATH_WAIT_S; `it`: None for any live iterator."""
    if isinstance(exc, WorkerLost):
        return None
    torchs = "DataLoader worker (pid" in str(exc)
    pids = {int(p) for p in re.findall(r"\d+", str(exc).split(")", 1)[0])} if torchs else set()
    workers = [(i, w) for each in ([it] if it is not None else list(_live))
               for i, w in enumerate(getattr(each, "_workers", []))]  # (worker id, process)
    named = [(i, w) for i, w in workers if w.pid in pids] or workers
    dead = died_by_signal([w for _, w in named], failure.PEER_DEATH_WAIT_S if from_a_dead_peer(exc) else 0.0)
    if dead is not None:
        return WorkerLost(_lost_message(named[dead[0]][0], dead[1], dead[2]))
    if not torchs:
        return None
    return WorkerLost(f"a DataLoader worker ended unexpectedly ({str(exc).splitlines()[0]}); lower "
                      "data.num_workers or give the job more memory if the system log shows the OOM killer")


def _lost_message(worker_id: int, pid: int, signum: int) -> str:
    name = signal.Signals(signum).name if signum in signal.valid_signals() else f"signal {signum}"
    hint = ("the kernel's OOM killer sends SIGKILL when memory runs out: lower data.num_workers (or "
            "data.shuffle_buffer, data.read_ahead_bytes), or give the job more memory"
            if signum == signal.SIGKILL else "see the system log for who sent it")
    return f"DataLoader worker {worker_id} (pid {pid}) was killed by {name}; {hint}"


def end_workers(timeout: float = 5.0) -> None:
    """SIGKILL every DataLoader worker of this process and reap it (a failing rank's path: they ignore SIGTERM, and
    an iterator kept alive by a traceback would otherwise be joined forever at exit). Bounded by `timeout`."""
    procs = []
    for it in list(_live):
        with contextlib.suppress(Exception):
            from torch.utils.data import _utils  # imported: `it` is a torch iterator

            if getattr(it, "_worker_pids_set", False):  # torch's SIGCHLD check must not raise about our kills
                _utils.signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False
        procs += list(getattr(it, "_workers", []))
    procs += [p for p in multiprocessing.active_children() if p not in procs]
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for it in list(_live):
        with contextlib.suppress(Exception):
            _abandon(it)
        _live.discard(it)


def _abandon(it: Any) -> None:
    """torch's `_shutdown_workers` for an iterator whose workers were SIGKILLed, without its `Event.set()`: the
    done event's lock is shared with the workers, which take it on every index they receive (`Event.is_set`), so a
    worker killed inside that moment left it held and `set()` waited for it forever (a failing rank that had just
    handed a worker its next index: no line, no result.json). The queues are closed here; `_shutdown` makes torch's
    own shutdown (`__del__`) do nothing more."""
    it._shutdown = True
    for q in getattr(it, "_index_queues", []):
        q.cancel_join_thread()
        q.close()


class TrainLoader:
    """Collated micro-batches of one rank. Iterating yields the rest of the current epoch from where it stands.

    Runner protocol::

        loader.load_state_dict(state)                  # when resuming (else it starts at epoch 0)
        for epoch in itertools.count(loader.epoch):    # or range(loader.epoch, cfg.trainer.epochs)
            loader.set_epoch(epoch)                    # same epoch as the loaded state: keeps the position
            for batch in loader: ...                   # the epoch's remaining micro-batches, equal on all ranks
        json.dump(loader.state_dict(), ...)            # after an optimizer step, per rank

    A loader whose `steps_per_epoch` is None would be an endless stream (iterating moves to the next epoch by
    itself); the built-in strategies all know their epoch length (iterable: counted by its index). Every batch
    carries `epoch` for the ledger.
    """

    kind: str = ""

    def __init__(
        self,
        layout: Layout,
        rank: int,
        seed: int,
        shuffle: bool,
        fingerprint: Dict[str, Any],
        global_rank: Optional[int] = None,
    ):
        if not 0 <= rank < layout.world_size:
            raise ValueError(f"rank {rank} outside world size {layout.world_size}")
        self.layout = layout  # the layout positions are planned in (presharded: a world of one over the own part)
        self.rank = rank  # the rank inside that layout
        self.global_rank = rank if global_rank is None else global_rank
        self.seed = seed
        self.shuffle = shuffle
        self.fingerprint = dict(fingerprint, kind=self.kind, seed=seed, shuffle=shuffle)
        self.epoch = 0
        self._offset = 0  # global position where the current epoch plan starts (nonzero after an elastic resume)
        self._micro = 0  # micro-batches of this plan consumed by the caller
        self._start_micro = 0  # where the next iteration starts inside the plan

    # -- what a strategy provides ------------------------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> Optional[int]:
        raise NotImplementedError

    def _batches(self, offset: int, start_micro: int) -> Iterator[Batch]:
        """The remaining micro-batches of epoch `self.epoch` for a plan at `offset`, from micro `start_micro`."""
        raise NotImplementedError

    @property
    def endless(self) -> bool:
        return self.steps_per_epoch is None

    # -- shared ------------------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless the loader already stands in it (e.g. after a resume)."""
        if epoch != self.epoch:
            self.epoch, self._offset, self._micro, self._start_micro = epoch, 0, 0, 0

    def __iter__(self) -> Iterator[Batch]:
        while True:
            self._start_micro = self._micro
            for batch in self._batches(self._offset, self._micro):
                self._micro += 1
                batch["epoch"] = self.epoch
                yield batch
            if not self.endless:
                return
            self.epoch, self._offset, self._micro, self._start_micro = self.epoch + 1, 0, 0, 0

    def position(self) -> Position:
        lay = self.layout
        return Position(self.epoch, self._offset, self._micro, lay.world_size, lay.micro_batch_size, lay.grad_accum)

    def state_dict(self) -> Dict[str, Any]:
        pos = self.position()
        return {
            "version": STATE_VERSION,
            "rank": self.global_rank,
            "position": pos.to_dict(),
            "samples_consumed": pos.samples_consumed,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data state version {state.get('version')!r} is not {STATE_VERSION}; cannot resume")
        self.check_fingerprint(state)
        saved = Position(**state["position"])
        try:
            self.epoch, self._offset, self._micro = resume_point(saved, self.layout)
        except ValueError as exc:
            raise DataError(str(exc)) from None
        self._start_micro = self._micro

    def check_fingerprint(self, state: Dict[str, Any]) -> None:
        changed = [
            f"{k}: {state['fingerprint'].get(k)!r} -> {v!r}"
            for k, v in self.fingerprint.items()
            if state["fingerprint"].get(k) != v
        ]
        if changed:
            raise DataError(
                "cannot resume the data position exactly: the data setup changed since the checkpoint ("
                + "; ".join(changed)
                + "). Resume with the original settings, or start a fresh run (trainer.resume=never)"
            )

