"""The run's final barrier, watched: every rank stopped its heartbeat (core/heartbeat.py) before it, so ranks that
finish and exit at different times are never taken for dead, and a peer that froze or died on its way there would
hold the others for the process-group timeout. Here a thread of each waiting rank reads which ranks arrived (a list
in the job's store) and how long each one not arrived has not beaten: one still beating is finishing (its
own watchdog bounds it); one that stopped beating (done, or silent) and has not arrived after
`launcher.peer_timeout_s` is named and the run ends (exit PEER_LOST_EXIT, heartbeat's report); a line now and then
meanwhile, from the lowest-numbered rank of each node that arrived. A store gone once the barrier passed (rank 0,
its host, left) is not a failure.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, List, Set, Tuple

import dsrecipes.core.heartbeat as heartbeat
import dsrecipes.core.stall as stall

FINAL_NOTE_S = 10.0  # the first "waiting for" line after this long, then every 3 times that


def final_barrier(barrier: Callable[[], None]) -> None:
    """Call `barrier` (the run's last), watched (this module's docstring) by the heartbeat `heartbeat.stop` left."""
    beat, done = heartbeat.stopped(), threading.Event()
    if beat is None or beat.world_size < 2:
        return barrier()
    try:
        arrive(beat)
        threading.Thread(target=_watch, args=(beat, done), name="dsrecipes-final-barrier", daemon=True).start()
    except Exception:  # noqa: BLE001 - the store's host is gone: the barrier fails on its own
        pass
    try:
        return barrier()
    finally:
        done.set()


def arrive(beat: "heartbeat.Heartbeat") -> None:
    """Note this rank at the barrier: one list of ranks in the job's store, read in one call (`arrived`), not a key
    per rank that every waiting rank would look up one by one each beat (world size squared calls a second)."""
    beat.store.append(f"{beat.prefix}/final", f"{beat.rank},")


def arrived(beat: "heartbeat.Heartbeat") -> Set[int]:
    return {int(r) for r in beat.store.get(f"{beat.prefix}/final").decode().split(",") if r}


def _watch(beat: "heartbeat.Heartbeat", done: threading.Event) -> None:
    """The watch until `done`: the ranks not arrived, how long each has not beaten."""
    began, seen, since = time.monotonic(), {}, {}
    note = began + FINAL_NOTE_S
    while not done.wait(heartbeat.INTERVAL_S):
        now = time.monotonic()
        try:
            missing = sorted(set(range(beat.world_size)) - arrived(beat))
            beats = beat.read_beats(missing) if missing else {}
            beat.learn_places()
        except Exception as exc:  # noqa: BLE001 - rank 0, the store's host, leaves once past the barrier
            if not done.wait(heartbeat.CRASH_GRACE_S):
                beat._fail([], f"the job's store at {beat._store_name()} stopped answering at the run's final "
                               f"barrier ({type(exc).__name__})")  # fmt: skip
            return
        for r in missing:  # (a rank that never beat: silent from the first look)
            if r not in since or seen.get(r) != beats.get(r):
                seen[r], since[r] = beats.get(r), now
        silent = [r for r in missing if now - since[r] > beat.timeout_s]
        if silent:
            beat._fail(silent, f"no heartbeat for {beat.timeout_s:.0f} s and not at the run's final barrier")
        if missing and now >= note and _says(beat, missing):
            note = now + 3 * FINAL_NOTE_S
            print(f"dsrecipes: rank {beat.rank}: waiting {now - began:.0f} s at the run's final barrier for "
                  f"{', '.join(stall.where(w) for w in beat._describe(missing))} (one that stopped is named after "
                  f"launcher.peer_timeout_s={beat.timeout_s:.0f})", file=sys.stderr, flush=True)  # fmt: skip


def _says(beat: "heartbeat.Heartbeat", missing: List[int]) -> bool:
    """Whether this rank prints the waiting line: the lowest-numbered rank of its node that arrived (the first rank
    of a node may be the late one), so each node's console has one. While not every rank's place is known (one never
    registered): the first rank of each node, as before."""
    places = beat._who
    if len(places) < beat.world_size:
        return beat.monitor
    node = _node(places[beat.rank])
    return beat.rank == min(r for r in range(beat.world_size) if r not in missing and _node(places[r]) == node)


def _node(who: Dict[str, Any]) -> Tuple[Any, Any]:
    return who.get("node"), who.get("host")
