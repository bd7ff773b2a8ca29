"""SIGTERM and SIGINT mean "stop at the next step boundary, keep the work": recorded here, acted on by the code that
runs the work.

The launching process forwards the signal to its launcher's whole process group and gives the ranks
`trainer.stop_grace_s` to finish before it kills what is left (launch/process.py). Every rank records it; at the
next optimizer-step boundary the ranks agree (one small all-reduce per step, so all of them stop at the same step),
save a checkpoint and end with the exit code of the signal (train.py).

Signals that arrive together are one interruption: a wrapper that forwards signals (`timeout`, CI runners, `srun`)
delivers the terminal's Ctrl-C a second time within milliseconds, and that copy must not throw the checkpoint away.
Only a SIGINT more than `SAME_INTERRUPTION_S` after the first one was acknowledged (the "stopping at the next step
boundary" line) stops at once; `forced()` then says so, for the message naming the latest checkpoint. A run
whose work did not stop within its grace is stopped the same way (`stop_now`: launcher=local), as the first signal's
interruption (its exit code), and `forced()` says that instead of "a second SIGINT".

`handling()` blocks nest (the local launcher runs the rank inside the launching process): the outermost installs
the OS handlers, every active block's callback is told about the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A hang-up (the terminal or the ssh session that started the run closed) is SIGTERM: stop at the step boundary,
# keep the work, forward SIGTERM to the ranks (their DataLoader workers ignore SIGTERM, not SIGHUP). Was: death.
# Where it is ignored (`nohup`: the user asked the run to outlive the terminal) it stays ignored.
AS_SIGTERM = (signal.SIGHUP,)


def _caught(signals: tuple) -> tuple:
    """`signals` but those of AS_SIGTERM that this process ignores (started under nohup)."""
    return tuple(s for s in signals if s not in AS_SIGTERM or signal.getsignal(s) is not signal.SIG_IGN)
SAME_INTERRUPTION_S = 1.0  # signals closer than this to the acknowledged first one are that same interruption

_received: Optional[int] = None
_acknowledged_at: float = 0.0  # time.monotonic() when the first signal was acknowledged
_forced: Optional[str] = None  # how the work was stopped at once (None: it was not)
_stop_now: Optional[str] = None  # set by `stop_now`: the next signal stops the work at once, saying this
_cause: Optional[str] = None  # set by `stopped_for`: why this process stopped the work itself, no signal to it
_callbacks: List[Callable[[int], None]] = []
_announce: List[bool] = []
_owner = 0  # the process whose outermost `handling()` installed the handlers


def requested() -> Optional[int]:
    """The first stop signal received since `reset()`, else None."""
    return _received


def forced() -> Optional[str]:
    """How the work was stopped at once ("stopped at once by a second SIGINT", or what `stop_now` was told), else
    None."""
    return _forced


def stop_now(why: str) -> None:
    """The work did not stop within its grace (another thread says so, then sends SIGINT to the main thread): that
    signal stops it at once as the first signal's interruption (`Stopped(requested())`, that signal's exit code), not
    as a second Ctrl-C, and however soon after the first, with `forced()` saying `why`."""
    global _stop_now
    _stop_now = why


def stopped_for(why: str) -> None:
    """This process stopped the work itself, as a SIGTERM stops it, though no stop signal came to it (the ranks'
    launcher was killed: launch/process.py): the run's outcome says `why`, not 'interrupted by SIGTERM'."""
    global _cause
    _cause = why


def cause() -> Optional[str]:
    """What `stopped_for` was told since `reset()`, else None."""
    return _cause


def reset() -> None:
    global _received, _forced, _stop_now, _cause
    _received = None
    _forced = None
    _stop_now = None
    _cause = None


def exit_code(signum: int) -> int:
    """What a shell reports for a process ended by `signum` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


def _handler(signum: int, frame: object) -> None:
    global _received, _acknowledged_at, _forced
    if signum in AS_SIGTERM and os.getpid() != _owner:
        return  # a forked child (a DataLoader worker) got the terminal's hang-up too: its parent stops, and ends it
    signum = signal.SIGTERM if signum in AS_SIGTERM else signum
    if _received is not None:
        if _stop_now is not None:  # out of its grace: stopped as the first signal's interruption
            _forced = _stop_now
            raise Stopped(_received)
        if time.monotonic() - _acknowledged_at < SAME_INTERRUPTION_S:
            return  # the same interruption, delivered again (a forwarding wrapper): already being acted on
        if signum == signal.SIGINT:
            _forced = "stopped at once by a second SIGINT"
            raise KeyboardInterrupt  # Ctrl-C again, after the acknowledgement: stop now
    first = _received is None
    if first:
        # Recorded before anything else runs: the wrapper's copy can arrive while this handler is still printing
        # (Python runs the next handler inside this one), and must find the interruption already acknowledged.
        _received, _acknowledged_at = signum, time.monotonic()
    if first and any(_announce):
        print(f"\n{signal.Signals(signum).name}: stopping at the next step boundary and saving a checkpoint "
              "(Ctrl-C again, after this line, stops at once)", file=sys.stderr, flush=True)
    for callback in list(_callbacks):
        callback(signum)


class Stopped(KeyboardInterrupt):
    """SIGTERM outside a `handling()` block (the launching process preparing data, a subcommand at work), raised as
    Python raises KeyboardInterrupt for SIGINT: the same path, so every `finally` runs (worker pools stop, staging
    directories go) and the run is reported interrupted, with the exit code of the signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(exc: KeyboardInterrupt) -> int:
    """The stop signal behind a KeyboardInterrupt: SIGTERM for `Stopped`, else SIGINT."""
    return getattr(exc, "signum", signal.SIGINT)


@contextmanager
def raising() -> Iterator[None]:
    """Within the block, SIGTERM raises `Stopped` in this process (the main thread only; elsewhere nothing
    changes). A process forked meanwhile inherits the handler but ends as SIGTERM ends it, without a traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def _raise(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a forked worker: the default action, as if no handler were installed
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Stopped(signal.SIGTERM)

    previous = {s: signal.signal(s, _raise) for s in _caught((signal.SIGTERM, *AS_SIGTERM))}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def handling(on_signal: Optional[Callable[[int], None]] = None, announce: bool = False) -> Iterator[None]:
    """Within the block, SIGTERM/SIGINT are recorded (and passed to `on_signal`) instead of ending the process.
    Only the main thread can own signal handlers; elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _owner
    outermost = not _announce
    _owner = os.getpid() if outermost else _owner
    previous = {s: signal.signal(s, _handler) for s in _caught(STOP_SIGNALS + AS_SIGTERM)} if outermost else {}
    if on_signal is not None:
        _callbacks.append(on_signal)
    _announce.append(announce)
    try:
        yield
    finally:
        _announce.pop()
        if on_signal is not None:
            _callbacks.remove(on_signal)
        for sig, old in previous.items():
            signal.signal(sig, old)


def watch(alive: Callable[[], bool], grace_s: float, what: str, poll_s: float = 2.0) -> threading.Thread:
    """A daemon thread that ends this process when `alive()` has been false for `grace_s` (a rank whose launching
    process died and that is stuck where no step boundary comes, e.g. in a collective with a dead peer: without
    this it would outlive everything until the process-group timeout). Reaching a step boundary first is the
    normal way out (train.py stops there on its own)."""

    def run() -> None:
        gone_since: Optional[float] = None
        while True:
            time.sleep(poll_s)
            if alive():
                gone_since = None
                continue
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > grace_s:
                print(f"error: {what} is gone and this rank did not stop within {grace_s:.0f} s; exiting",
                      file=sys.stderr, flush=True)
                os._exit(exit_code(signal.SIGTERM))

    thread = threading.Thread(target=run, name="dsrecipes-launcher-watch", daemon=True)
    thread.start()
    return thread
