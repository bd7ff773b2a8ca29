"""Rank liveness across nodes: every rank beats in the job's store, and a silent peer ends the run in bounded time.

A node that dies hard (power, kernel, a cut network) closes no TCP connection, so the other ranks would sit in their
next collective until the process-group timeout (30 minutes by default). Instead each rank runs a daemon thread
that bumps its counter in the job's TCPStore (MASTER_ADDR:MASTER_PORT: rank 0's store, or torchrun's agent store)
every second; the first rank of each node also reads every counter. A counter that stops moving for
`launcher.peer_timeout_s`, or a store that stops answering for that long, ends this rank (exit PEER_LOST_EXIT) after
it wrote `<run>/failure.json`: which ranks went silent, on which node (node rank, host, address). It tells the other
ranks in the store too, in their own counters, so each learns it from the answer to its next beat (one store call a
beat whatever happens; not in the file: hundreds of ranks each second on a shared file system), and they stop
quietly. The launcher of each surviving node then stops its other ranks, and the launching process names the failed
node from that file (`describe_failure`). A rank that crashes on a broken connection (a killed peer does close its
sockets) first asks the same counters who is gone (`explain_crash`), so both ways end in the same report.

Every rank starts beating right after the rendezvous, before the process group starts (a rank never seen beating
is silent from the first look). A rank stops its heartbeat (marking itself done) before the final barrier, so ranks
that finish and exit at different times are never taken for dead; there, core/final_barrier.py names a peer that
stopped beating and does not arrive. Threads keep beating while the main thread computes or waits in a
collective (both release the GIL), so only a dead or unreachable process goes silent. A live rank that stopped making
progress is the stall watchdog's (core/stall.py): each beat carries the main thread's step and phase, and the same
reading ranks judge them (a lone rank too, then: its own store is the job's).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import dsrecipes.core.stall as stall
from dsrecipes.core.failure import FAILURE_FILE, describe_failure, read_failure, write_failure
from dsrecipes.core.rundir import write_result
from dsrecipes.core.runplan import reported_by_launcher
from dsrecipes.core.whoami import whoami

PEER_LOST_EXIT = 75  # EX_TEMPFAIL: the run can be resumed with the same command
PREFIX = "dsrecipes/heartbeat"
DONE = b"done"  # what `read_beats` says of a rank that stopped beating
# A counter holds beats + FAILED per published report (`_publish`: news, never progress) + DONE_MARK once its rank
# stopped. Always a number: an add that meets a word makes torch's store close the adder's connection ("stoll").
FAILED = 1 << 40
DONE_MARK = 1 << 56
INTERVAL_S = 1.0
CRASH_GRACE_S = 4.0  # after a broken collective: a peer silent this long is gone
QUIET_S = 2.5 * INTERVAL_S  # not beating now: reported along with a peer past the timeout
FOLLOW_S = 2 * INTERVAL_S  # a reporting rank stays up this long at most for the others to read its report
STOP_S = 1.0  # `stop` waits this long for the heartbeat's threads (a store call in flight: milliseconds)
AGENT_GONE_S = 1.0  # a store gone: how long to look whether torchrun's agent (this rank's parent) went with it

_current: Optional["Heartbeat"] = None
_stopped: Optional["Heartbeat"] = None  # stopped before the final barrier, which it watches


def start(run_dir: Path, rank: int, world_size: int, timeout_s: int, stall_warn_s: int = 0, stall_timeout_s: int = 0,
          *, in_process: bool = False, before_exit: Optional[Callable[[], None]] = None) -> Optional["Heartbeat"]:
    """Start this rank's heartbeat (nothing with launcher.peer_timeout_s=0, nor for a lone process without the stall
    watchdog: launcher.stall_warn_s, launcher.stall_timeout_s). `in_process`: this rank runs in the launching process
    (launcher=local), so a failure it detects is recorded here (result.json) as the launching process would;
    `before_exit`: what must not outlive this process (its DataLoader workers), ended before it exits."""
    global _current, _stopped
    _stopped, lone = None, world_size < 2
    if lone and stall_warn_s <= 0 and stall_timeout_s <= 0 or timeout_s <= 0:
        return None
    if not lone and ("MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        return None
    beat = Heartbeat(Path(run_dir), rank, world_size, float(timeout_s), stall.Watch(stall_warn_s, stall_timeout_s))
    beat.in_process, beat.before_exit = in_process, before_exit
    try:
        beat.start()
    except Exception as exc:  # noqa: BLE001 - a safety net must not be what stops a run
        print(f"dsrecipes: warning: rank {rank} runs without a heartbeat ({type(exc).__name__}: {exc}); a dead node "
              "would leave it waiting for the process-group timeout", file=sys.stderr, flush=True)  # fmt: skip
        return None
    _current = beat
    return _current


def stop() -> None:
    """Mark this rank done and stop beating (before the final barrier, which it then watches: core/final_barrier.py)."""
    global _current, _stopped
    if _current is not None:
        _current.stop()
        _stopped, _current = _current, None


def stopped() -> Optional["Heartbeat"]:
    """The heartbeat `stop` stopped last, for the final barrier's watch (core/final_barrier.py)."""
    return _stopped


def stop_alone() -> None:
    """After a failed setup: a lone rank's watchdog does not outlive its run (the launching process that ran it
    in-process goes on). A rank of a job keeps beating for `explain_crash`; its process ends anyway."""
    if _current is not None and _current.world_size == 1:
        stop()


def explain_crash() -> None:
    """Called while an exception ends this rank: if peers are gone, report them (and exit) instead of a traceback."""
    if _current is not None:
        _current.explain_crash()


class Heartbeat:
    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float, watch: Optional[stall.Watch] = None):
        self.run_dir, self.rank, self.world_size, self.timeout_s = run_dir, rank, world_size, timeout_s
        self.watch, self.progress, self.published = watch, stall.current, ""
        self.in_process, self.before_exit = False, None  # (start(): launcher=local; the rank's DataLoader workers)
        self.master = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0")))
        self.monitor = os.environ.get("LOCAL_RANK", "0") == "0"
        self.prefix = f"{PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self._stop, self._beating_ended = threading.Event(), threading.Event()  # (the guard watches until the latter)
        self.threshold, self.started, self.count = timeout_s, time.time(), 0  # count: this rank's beats, as answered
        self._registered: set = set()  # ranks whose counter exists: read without a look first (`read_beats`)
        self._failing, self._agent_gone, self._last_ok, self._who = threading.Lock(), threading.Lock(), time.monotonic(), {}
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent (our parent) serves it
        self.store_host, self.agent = [] if rank == 0 or agent_store else [0], os.getppid() if agent_store else None
        self._thread = threading.Thread(target=self._loop, name="dsrecipes-heartbeat", daemon=True)
        self._guard_thread = threading.Thread(target=self._guard, name="dsrecipes-heartbeat-guard", daemon=True)

    def start(self) -> None:
        import torch.distributed as dist

        if self.world_size == 1:  # a lone rank (launcher=local in-process, or one process): only its own watchdog,
            self.store = dist.HashStore()  # in this process - no store may be served at MASTER_ADDR:MASTER_PORT
        else:
            self.store = dist.TCPStore(self.master[0], self.master[1], is_master=False, wait_for_workers=False,
                                       timeout=timedelta(seconds=self.timeout_s))  # fmt: skip
        self.store.set(self._key("who", self.rank), json.dumps(whoami(self.rank, self.master[0])))
        stall.reset()
        self._beat()  # (a report already published: the thread's first beat follows it)
        self._last_ok = time.monotonic()
        self._thread.start()
        self._guard_thread.start()

    def stop(self) -> None:
        """Stop beating; the beating thread marks this rank done on its way out (`_loop`). Bounded: STOP_S for both
        threads. A beat's store call that does not return (a store gone silent) cannot be cut short: it is named,
        and the guard stays to end this rank if the store stays silent for the timeout, as it would mid-run."""
        self._stop.set()
        deadline = time.monotonic() + STOP_S
        for thread in (self._thread, self._guard_thread) if self._thread.ident is not None else ():
            thread.join(timeout=max(deadline - time.monotonic(), INTERVAL_S / 10))
            if thread.is_alive():
                print(f"dsrecipes: rank {self.rank}: {thread.name} did not end in {STOP_S:.0f} s: the job's store at "
                      f"{self._store_name()} did not answer (this rank: done when it does, ended if it stays silent "
                      f"for launcher.peer_timeout_s={self.timeout_s:.0f})", file=sys.stderr, flush=True)  # fmt: skip
                return

    def explain_crash(self) -> None:
        """Look at the peers for a short while with a short threshold; `_fail` exits if any is gone. Not for a lone
        rank (no peer to lose), nor when another rank already reported its own failure in this session (failure.json):
        that is the cause, the first report stands; the look would only hold this rank up CRASH_GRACE_S + 3 beats."""
        report = read_failure(self.run_dir) or {}
        if self.world_size < 2 or isinstance(report.get("cause"), str) and report.get("rank") != self.rank and \
                report.get("time", 0) >= self.started:
            return
        self.monitor, self.threshold = True, min(self.threshold, CRASH_GRACE_S)
        if self._thread.is_alive():
            self._thread.join(timeout=self.threshold + 3 * INTERVAL_S)

    def _store_name(self) -> str:
        return f"{self.master[0]}:{self.master[1]} (the first node: rank 0 or torchrun's agent)"

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def _loop(self) -> None:
        try:
            self._beating()
            if not self._failing.locked():  # stopped (`stop`), not ending the run: peers take this rank for done
                with contextlib.suppress(Exception):  # (the run is over for it; a store gone does not matter now)
                    self.store.set(self._key("beat", self.rank), str(DONE_MARK))
        finally:
            self._beating_ended.set()

    def _beating(self) -> None:
        tick = time.monotonic()  # every rank met at the rendezvous before it started: one never seen is silent
        last_value: Dict[int, Optional[bytes]] = dict.fromkeys(range(self.world_size))
        last_change = dict.fromkeys(range(self.world_size), tick)
        while not self._stop.wait(INTERVAL_S):
            try:
                self._agent_lost()  # (the store answers: another node's agent serves it; the peers wait for its save)
                if self._beat():
                    self._follow()
                if self.store_host and 0 not in self._who and self.store.check([self._key("who", 0)]):
                    self._describe([0])  # where rank 0 runs, learned once: its store can only be named while it is up
                if self.monitor:
                    now = time.monotonic()
                    starved, tick = now - tick - INTERVAL_S, now  # this process did not run: peers not judged on it
                    if starved > INTERVAL_S:
                        last_change = {r: t + starved for r, t in last_change.items()}
                        if self.watch is not None:
                            self.watch.shift(starved)
                    beats = self.read_beats()
                    for r, value in beats.items():
                        if last_value.get(r) != value:
                            last_value[r], last_change[r] = value, now
                    quiet = {r: now - last_change[r] for r, v in last_value.items() if v != DONE}
                    if any(t > self.threshold for t in quiet.values()) and not self._stop.is_set():
                        # with it, every rank that is not beating now (its node's other ranks died with it)
                        lost = [r for r, t in quiet.items() if t > QUIET_S]
                        self._fail(lost, f"no heartbeat for {self.threshold:.0f} s")
                    self._judge_progress(beats, now)
                self._last_ok = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the store's host died (connection reset) or timed out
                if not self._stop.is_set():
                    self._store_lost(f"the job's store at {self._store_name()} stopped answering ({type(exc).__name__})")

    def _beat(self) -> bool:
        """The counter (a round trip: a store that stopped answering shows here), and where the main thread is
        (core/stall.py) when that changed (a set is not answered: it shows nothing of the store's health). Returns
        whether a report was published (`_publish` added FAILED to this counter): the news costs no call."""
        where = self.progress.encode()
        if where != self.published:
            self.store.set(self._key("where", self.rank), where)
            self.published = where
        self.count = int(self.store.add(self._key("beat", self.rank), 1))
        return self.count % DONE_MARK >= FAILED

    def _judge_progress(self, beats: Dict[int, bytes], now: float) -> None:
        """The stall watchdog: one line per launcher.stall_warn_s (rank 0), the run ended at stall_timeout_s."""
        if self.watch is None or self._stop.is_set() or len(beats) < self.world_size:
            return  # (every rank's place is known once every rank beats: each sets it before its first beat)
        where = self.store.multi_get([self._key("where", r) for r in range(self.world_size)])
        positions = {r: None if beats[r] == DONE else w.decode(errors="replace") for r, w in enumerate(where)}
        verdict = self.watch.observe(positions, now)
        if verdict is None:
            return
        kind, behind, quiet = verdict
        named = [dict(self._describe([r])[0], step=s, phase=p, for_s=round(t, 1)) for r, s, p, t in behind]
        if kind == "fail":
            self._fail([], f"no step progress for {quiet:.0f} s: launcher.stall_timeout_s={self.watch.timeout_s:.0f}",
                       stalled=named)  # fmt: skip
        elif self.rank == 0:
            bound = f"the run ends at launcher.stall_timeout_s={self.watch.timeout_s:.0f}" if self.watch.timeout_s \
                else "no bound: launcher.stall_timeout_s=0"
            print(f"dsrecipes: waiting {quiet:.0f} s: {stall.describe(named)} ({bound})", file=sys.stderr, flush=True)

    def _guard(self) -> None:
        """A store call stuck on a silent network never returns; this thread (no I/O) notices that. Time in which
        this process itself did not run (a C call holding the GIL, a machine starved of CPU) is not the store's
        silence: a gap between two of this thread's own ticks is added to the store's allowance."""
        tick = time.monotonic()
        while not self._beating_ended.wait(INTERVAL_S):
            now = time.monotonic()
            starved, tick = now - tick - INTERVAL_S, now
            if starved > INTERVAL_S:
                self._last_ok += starved
            if now - self._last_ok > self.timeout_s + 2 * INTERVAL_S:
                self._store_lost(f"the job's store at {self._store_name()} did not answer for {self.timeout_s:.0f} s")

    def read_beats(self, ranks: Optional[List[int]] = None) -> Dict[int, bytes]:
        """The counters of `ranks` (all), in one call once each registered (none missing: no call ever blocks):
        the beats alone (a published report's FAILED is news, not a beat: a silent rank does not seem to move), or
        DONE for a rank that stopped."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        keys = [self._key("beat", r) for r in ranks]
        if not self._registered.issuperset(ranks):  # (a counter, once there, stays: looked for until then)
            if not self.store.check(keys):  # a rank that has not registered yet cannot be read without blocking
                return {r: _beats(v) for r, v in ((r, self._peek(k)) for r, k in zip(ranks, keys)) if v is not None}
            self._registered.update(ranks)
        self.learn_places()
        return {r: _beats(v) for r, v in zip(ranks, self.store.multi_get(keys))}

    def learn_places(self) -> Dict[int, Dict[str, Any]]:
        """Where each rank runs (whoami), read once every rank registered (one call: no rank ever waited for)."""
        keys = [self._key("who", r) for r in range(self.world_size)]
        if len(self._who) < self.world_size and self.store.check(keys):
            self._who = {r: json.loads(raw) for r, raw in enumerate(self.store.multi_get(keys))}
        return self._who

    def _peek(self, key: str) -> Optional[bytes]:
        return self.store.get(key) if self.store.check([key]) else None

    def _describe(self, ranks: List[int]) -> List[Dict[str, Any]]:
        for r in ranks:
            if r not in self._who:
                try:
                    raw = self._peek(self._key("who", r))
                    self._who[r] = json.loads(raw) if raw else {"rank": r}
                except Exception:  # noqa: BLE001
                    self._who[r] = {"rank": r}
        return [self._who[r] for r in ranks]

    def _store_lost(self, reason: str) -> None:
        """The store stopped answering: a peer is lost (`_fail`), or the agent that served it (then: beating ends)."""
        if not self._agent_lost(AGENT_GONE_S):
            self._fail(self.store_host, reason)
        elif self._failing.acquire(blocking=False):
            self._stop.set()

    def _agent_lost(self, look_s: float = 0.0) -> bool:
        """Whether torchrun's agent (this rank's parent: TORCHELASTIC_USE_AGENT_STORE) is gone, looked for up to `look_s`
        (its sockets close a moment before the kernel hands its children on). The first time (the rank not ending
        already: `_fail`) the rank stops as on SIGTERM, with a checkpoint at the next step boundary (tree.py bounds it)."""
        deadline = time.monotonic() + look_s
        while self.agent == os.getppid() and time.monotonic() < deadline:
            time.sleep(INTERVAL_S / 20)
        gone = self.agent not in (None, os.getppid())
        if gone and self._agent_gone.acquire(blocking=False) and not self._failing.locked():
            os.kill(os.getpid(), signal.SIGTERM)
        return gone

    def _fail(self, ranks: List[int], reason: str, stalled: Optional[List[Dict[str, Any]]] = None) -> None:
        if not self._failing.acquire(blocking=False):
            return  # the other thread is already reporting
        lost = self._describe(sorted(ranks))
        record = {"lost": lost, "reason": reason, "detected_by": whoami(self.rank, self.master[0]), "time": time.time()}
        if stalled:
            record["stalled"] = stalled  # alive, but no step progress (core/stall.py); "lost" stays empty
        first = write_failure(self.run_dir, record, unwritable_ok=True)  # (a full disk: the rank says it)
        self._exit(first, mine=first is record)

    def _follow(self) -> None:
        """Another rank's heartbeat ended the run (its report stands: `_publish`; this rank's beat said so): this rank
        stops too, before its next store call meets the store of a rank that is gone (torch prints a C++ stack).
        Read in the store, which this beat talks to anyway, not in failure.json (the module's docstring says why). A
        store already gone ends in `_fail`, which finds the report in the file (the first one stands), as quietly."""
        if self._stop.is_set():
            return
        report = json.loads(self.store.get(self._key("failure", 0)))
        self.store.add(self._key("followed", 0), 1)
        if self._failing.acquire(blocking=False):
            self._exit(report, mine=False)

    def _publish(self, report: Dict[str, Any]) -> int:
        """Tell the other ranks (`_follow`) that this rank's report stands: the report, then FAILED added to every
        other rank's counter, answered by that rank's next beat (a call per rank, once, by this rank alone; hundreds
        of ranks each looking for a report every beat doubled the store's load). Returns how many ranks still beat and
        should read it (`_await_followers`). Not for a lone rank, nor through a store gone silent or whose host is lost
        (rank 0: `store_host`); `_exit` does not wait for this past its bound."""
        lost = {int(w["rank"]) for w in report.get("lost", [])}
        if self.world_size < 2 or not (lost or report.get("stalled")) or lost & set(self.store_host):
            return 0
        self.store.set(self._key("failure", 0), json.dumps(report))  # (before the news: one connection, in order)
        for r in range(self.world_size):
            if r != self.rank:
                self.store.add(self._key("beat", r), FAILED)
        return self.world_size - len(lost | {self.rank})

    def _await_followers(self, followers: int) -> None:
        """Keep this process, maybe the store's host (launcher=deepspeed: rank 0), up until `followers` ranks read
        the report, so none meets a store gone; bounded: FOLLOW_S (a rank at the final barrier no longer reads)."""
        deadline = time.monotonic() + FOLLOW_S
        while followers > 0 and int(self.store.add(self._key("followed", 0), 0)) < followers:
            if time.monotonic() > deadline:
                return
            time.sleep(INTERVAL_S / 10)

    def _exit(self, first: Dict[str, Any], mine: bool) -> None:
        """End this process with PEER_LOST_EXIT, its DataLoader workers first (`before_exit`, bounded). One message:
        the first report's, said by the launching process where one supervises (core/runplan.reported_by_launcher),
        else by the rank that wrote it, which then tells the others (`_publish`). In the launching process
        (launcher=local) the run ends as any failed one: an `error:` line and result.json (written last: the main
        thread may wake when its workers die)."""
        try:
            message = describe_failure(first)
            if self.in_process:
                print(f"error: {message}. Run the same command again to resume from the last checkpoint "
                      "(trainer.resume=auto)", file=sys.stderr, flush=True)  # fmt: skip
            elif mine and not reported_by_launcher(self.run_dir):
                print(f"dsrecipes: {message}; stopping rank {self.rank}", file=sys.stderr, flush=True)
            telling = threading.Thread(target=self._tell, args=(first,), name="dsrecipes-heartbeat-report", daemon=True)
            if mine:
                telling.start()
            with contextlib.suppress(Exception):
                if self.before_exit is not None:
                    self.before_exit()
            if mine:
                telling.join(timeout=FOLLOW_S + 2 * INTERVAL_S)
            if telling.is_alive():
                print(f"dsrecipes: rank {self.rank}: the job's store at {self._store_name()} did not take the report "
                      f"to the other ranks in {FOLLOW_S + 2 * INTERVAL_S:.0f} s; they find it in "
                      f"{self.run_dir / FAILURE_FILE}", file=sys.stderr, flush=True)  # fmt: skip
            if self.in_process:
                write_result(self.run_dir, PEER_LOST_EXIT, message)
            sys.stdout.flush()
        finally:  # whatever the above met (a lost console, a full disk): the exit comes
            self._stop.set()  # (where os._exit does not end the process, a test's stand-in: nor this heartbeat)
            os._exit(PEER_LOST_EXIT)

    def _tell(self, report: Dict[str, Any]) -> None:
        """`_publish`, then `_await_followers` (`_exit` waits for this with a bound: a store call may never return)."""
        with contextlib.suppress(Exception):
            self._await_followers(self._publish(report))


def _beats(counter: bytes) -> bytes:
    """A counter as read (`read_beats`): its beats alone, or DONE."""
    value = int(counter)
    return DONE if value >= DONE_MARK else str(value % FAILED).encode()

