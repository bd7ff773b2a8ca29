"""Step progress and the stall watchdog: where each rank's main thread is, and a run that stopped moving named.

A rank stuck outside any collective (a DataLoader worker alive but never answering, a store read that hangs) keeps
beating its heartbeat, so its peers sit in their next collective until the process-group timeout, silently. So the
main thread records where it is (`mark`: attribute assignments, no I/O): the step it completed and a phase among
PHASES. The heartbeat thread (core/heartbeat.py) publishes that with every beat, and the first rank of each node
hands every rank's position to a `Watch`: when no rank has moved for `launcher.stall_warn_s`, rank 0's node prints
one line per interval naming the rank(s) furthest behind (the lowest step, then the earliest phase in it), with
their node, host, step, phase and how long; after `launcher.stall_timeout_s` the run ends like a lost peer does
(<run>/failure.json with "stalled", exit heartbeat.PEER_LOST_EXIT). Setup (phase `start`) has its own bounds
(rendezvous, process group), so it only warns. With launcher.peer_timeout_s=0 there is no heartbeat: no watchdog.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

# In the order a rank goes through them with the same completed step: eval and checkpoint after step S, then the
# batches of step S + 1 (data, compute) until it completes. Setup first.
PHASES = ("start", "eval", "checkpoint", "data", "compute")
WHAT = {"start": "setup", "data": "next batch", "compute": "forward/backward/optimizer step", "eval": "evaluation",
        "checkpoint": "checkpoint save"}  # fmt: skip


class Progress:
    """This rank's place; written by the main thread only, read by the heartbeat thread."""

    __slots__ = ("step", "phase", "moves")

    def __init__(self) -> None:
        self.step, self.phase, self.moves = 0, "start", 0

    def encode(self) -> str:
        return f"{self.step} {self.phase} {self.moves}"


current = Progress()


def mark(phase: str, step: Optional[int] = None) -> None:
    """The main thread enters `phase` (one of PHASES) after completing `step` steps. Cheap: no I/O, no lock."""
    if step is not None:
        current.step = step
    current.phase = phase
    current.moves += 1


def reset() -> None:
    current.step, current.phase, current.moves = 0, "start", 0


def decode(value: str) -> Optional[Tuple[int, str, int]]:
    parts = value.split()
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in PHASES or not parts[2].isdigit():
        return None
    return int(parts[0]), parts[1], int(parts[2])


def where(who: Dict[str, Any]) -> str:
    """'rank 1 (node 0, host gpu7)'."""
    place = [f"node {who['node']}" if who.get("node") is not None else None,
             f"host {who['host']}" if who.get("host") else None]  # fmt: skip
    place = [p for p in place if p]
    return f"rank {who['rank']}" + (f" ({', '.join(place)})" if place else "")


def describe(stalled: List[Dict[str, Any]]) -> str:
    """'rank 1 (node 0, host h) at step 12, phase data (next batch) for 118 s' for each rank named."""
    return "; ".join(f"{where(w)} at step {w['step']}, phase {w['phase']} ({WHAT.get(w['phase'], '?')}) "
                     f"for {w['for_s']:.0f} s" for w in stalled)  # fmt: skip


class Watch:
    """Judges every rank's published position; `observe` says what to do now: None, or ("warn" | "fail", ranks,
    seconds without a move), ranks being [(rank, step, phase, seconds in that position)]. Times are the caller's
    monotonic clock."""

    def __init__(self, warn_s: float, timeout_s: float):
        self.warn_s, self.timeout_s = warn_s, timeout_s
        self.seen: Dict[int, Tuple[int, str, int]] = {}
        self.since: Dict[int, float] = {}
        self.warned_at = float("-inf")

    def shift(self, seconds: float) -> None:
        """This process did not run for `seconds` (starved): nobody is judged on that time."""
        self.since = {r: t + seconds for r, t in self.since.items()}
        self.warned_at += seconds

    def observe(self, positions: Dict[int, Optional[str]], now: float) -> Optional[Tuple[str, List[tuple], float]]:
        """`positions`: rank -> encoded Progress, None for a rank that is done (or not yet known). Returns the
        verdict, the ranks furthest behind and how long no rank moved."""
        for r, value in positions.items():
            pos = decode(value) if value is not None else None
            if pos is None:
                self.seen.pop(r, None)
                self.since.pop(r, None)
            elif self.seen.get(r) != pos:
                self.seen[r], self.since[r] = pos, now
        if not self.seen:
            return None
        quiet = now - max(self.since.values())  # since the last move of any rank
        low = min((s, PHASES.index(p)) for s, p, _ in self.seen.values())
        behind = [(r, s, p, now - self.since[r]) for r, (s, p, _) in sorted(self.seen.items())
                  if (s, PHASES.index(p)) == low]  # fmt: skip
        if self.timeout_s > 0 and quiet >= self.timeout_s and PHASES[low[1]] != "start":
            return "fail", behind, quiet
        if self.warn_s > 0 and quiet >= self.warn_s and now - self.warned_at >= self.warn_s:
            self.warned_at = now
            return "warn", behind, quiet
        return None
