"""The processes a launcher started, followed to their end: its process group (a launcher runs in a session of its
own), its tree, and what was seen of it (`Tree`): torchrun starts each rank in a session of its own, out of the
launcher's group, and a launcher killed by a signal leaves them orphaned, out of reach of its tree too."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Union

import psutil

KILLED_S = 10.0  # after SIGKILL: how long `kill_tree` waits for the processes to end
# In a launcher's environment, a value of its own (`mark`): every process it starts inherits it, so one started less
# than a poll before the launcher was killed, never seen, is still found as ours (`gather`).
MARK = "DSRECIPES_LAUNCH"
BORN_SLACK_S = 1.0  # psutil's start times count from the boot time it read (/proc/stat's btime, which may shift)


class Tree:
    """The launcher and every process it started, as last seen (`look`, each poll of `supervise`): torchrun starts
    each rank in a session of its own, out of the launcher's process group, and a launcher killed by a signal leaves
    its ranks orphaned, out of reach of its tree too. Those seen are still reachable: psutil checks a pid's start
    time, so a pid used again by another process is never signalled. With `mark` (MARK's value in the launcher's
    environment), what was never seen is found by it once the launcher has ended."""

    def __init__(self, pid: int, mark: Optional[str] = None) -> None:
        self.pid, self.mark = pid, mark
        self.seen: Dict[int, psutil.Process] = {}
        self.launcher: Optional[psutil.Process] = None
        with contextlib.suppress(psutil.Error):
            self.launcher = psutil.Process(pid)

    def look(self) -> List[psutil.Process]:
        """The launcher's descendants now (recorded as seen)."""
        try:
            found = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []
        for p in found:
            self.seen.setdefault(p.pid, p)
        return found

    def gather(self) -> None:
        """Record as seen this user's processes that carry the launcher's mark (none without one): those it started
        too shortly before it was killed to be seen (`look`, every 0.5 s). Only one younger than the launcher can
        (its descendants inherit it): the environments of the others are not read (each run's end, 1000 processes:
        ~1 ms, ~20 ms the first time, psutil's start times; was 40-70 ms). BORN_SLACK_S: psutil's clock may move."""
        if self.mark is None:
            return
        born = self.launcher.create_time() - BORN_SLACK_S if self.launcher is not None else 0.0
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if p.pid not in self.seen and p.create_time() >= born and p.uids().real == os.getuid() and \
                        p.environ().get(MARK) == self.mark:
                    self.seen[p.pid] = p

    def outside(self) -> List[psutil.Process]:
        """Those seen still running outside the launcher's process group (torchrun's ranks, orphaned or not)."""
        left = []
        for p in self.seen.values():
            with contextlib.suppress(OSError):
                if _running(p) and os.getpgid(p.pid) != self.pid:
                    left.append(p)
        return left

    def alive(self) -> bool:
        return group_alive(self.pid) or bool(self.outside())

    def signal(self, signum: int) -> None:
        """`signum` to the launcher's group; once the launcher has ended, also to each process seen outside it (a
        live torchrun passes a signal on to its ranks itself: a second SIGINT from here would stop them at once,
        stopping.py; DataLoader workers ignore SIGTERM and SIGINT: their rank stops them)."""
        signal_group(self.pid, signum)
        if self._launcher_running():
            return
        for p in self.outside():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signum)

    def _launcher_running(self) -> bool:
        try:
            return self.launcher is not None and self.launcher.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # ended and reaped (psutil checks the start time: not a new process with its pid)
            return False

    def end(self) -> None:
        """SIGKILL the launcher's tree and group and whatever was seen outside them (each with its descendants)."""
        self.look()
        self.gather()
        end_group(self.pid)
        for p in self.outside():
            kill_tree(p)

    def running(self) -> str:
        return still_running({self.pid} | {p.pid for p in self.outside()})


def still_running(pgids: Set[int]) -> str:
    """The ranks (their pids) still alive in the launcher's process group (or one of `pgids`: torchrun's ranks lead
    groups of their own), for a message; its other processes (the launcher, DataLoader workers: children of a process
    with the same rank) by pid and name when no rank is left."""
    ranks, others = [], []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) not in pgids:
                continue
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            rank = p.environ().get("RANK")
        except (OSError, psutil.Error):
            continue
        parent_rank = None
        with contextlib.suppress(OSError, psutil.Error):  # an orphan's parent: init, whose environment is not ours
            parent = p.parent()
            parent_rank = parent.environ().get("RANK") if parent is not None else None
        if rank is not None and rank.isdigit() and rank != parent_rank:
            ranks.append((int(rank), pid))
        elif rank is None:
            with contextlib.suppress(OSError, psutil.Error):  # (torchrun's agent calls itself pt_elastic)
                others.append(f"pid {pid} ({command_name(p.cmdline()) or p.name()})")
    if ranks:
        return ", ".join(f"rank {r} (pid {pid})" for r, pid in sorted(ranks))
    return ", ".join(others) or "the launcher's process group"


def command_name(args: Union[str, Sequence[str]]) -> str:
    """What a command line runs, for a message: the module of `python -m MODULE`, else its program's name."""
    args = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
    module = next((a for prev, a in zip(args, args[1:]) if prev == "-m"), None)
    return module or (Path(args[0]).name if args else "")


def end_group(pid: int) -> None:
    """SIGKILL the launcher's tree and its process group (a grandchild whose parent died is in the group only)."""
    kill_tree(pid)
    signal_group(pid, signal.SIGKILL)


def kill_tree(pid: Union[int, psutil.Process]) -> None:
    """SIGKILL a process and all its descendants, and wait (up to KILLED_S) until each has ended. The tree is frozen
    (SIGSTOP) first, so nothing it starts meanwhile (deepspeed's cleanup spawns `pdsh ... pkill` on a SIGTERM, which
    would hang on a dead host) escapes. `pid` as a psutil.Process (one seen before): not another process that has its
    pid now."""

    frozen: Dict[int, "psutil.Process"] = {}
    try:
        root = pid if isinstance(pid, psutil.Process) else psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for _ in range(10):
        try:
            found = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        new = [p for p in found if p.pid not in frozen]
        if not new:
            break
        for p in new:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.suspend()
            frozen[p.pid] = p
    for p in frozen.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _ended(list(frozen.values()), KILLED_S)


def _ended(procs: List[psutil.Process], timeout: float) -> None:
    """Wait until each of `procs` has ended: a zombie has (psutil.wait_procs waits on one that is not our child, an
    orphan that init reaps late or never, for its whole timeout; and reaping our own child here would make its Popen
    report exit code 0). The rank of a launcher that was killed (torchrun's: its own session) is waited for too, as
    its peers were: a rank still being torn down (a GPU's memory freed) must not meet the resume's ranks."""
    deadline = time.monotonic() + timeout
    while procs and time.monotonic() < deadline:
        procs = [p for p in procs if _running(p)]
        if procs:
            time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
