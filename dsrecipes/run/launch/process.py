"""Running a launch plan's commands on this machine: subprocesses (signal forwarding, a stop once a rank reported a
failed node) or in-process.

A launcher runs in a session of its own, so its whole tree (DeepSpeed's runner where it runs, its per-node
`launch.py`, the ranks and their DataLoader workers) is one process group. SIGTERM or SIGINT to the launching process
is forwarded to that group (deepspeed's runner would otherwise die alone and leave the ranks training), the ranks get
`grace_s` to reach a step boundary and save (stopping.py), then whatever is left of the group is killed. After a
normal end, leftovers of the group are killed too: a run leaves no process behind. torchrun starts each rank in a
session of its own: what the launcher started is also followed as last seen (tree.py), so ranks orphaned by a
launcher that was killed are stopped, waited for and ended the same way.
"""

from __future__ import annotations

import _thread
import dataclasses
import importlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import psutil

import dsrecipes.core.heartbeat as heartbeat
import dsrecipes.core.stopping as stopping
from dsrecipes.boundary.rank_env import rank_defaults
from dsrecipes.core.console import PROGRESS_ENV, log_path, progress_mode, relay
from dsrecipes.core.failure import killed_by, rank_failure
from dsrecipes.run.launch.plan import RANK_ENV, WORKER_MODULE, Command
from dsrecipes.run.launch.tree import MARK, Tree, command_name, kill_tree

FAILED_NODE_GRACE_S = 5  # after a rank reported a lost node: time for the launcher to stop the others itself
STOP_NOTE_S = 10.0  # after a stop signal: a line this often while the ranks save, naming those still running
_KILLED_ALONE: Dict[Path, str] = {}  # run directory -> its launcher's death with no rank left to stop (`killed_alone`)
_HUNG: Dict[Path, str] = {}  # run directory -> its launcher killed here after its ranks ended (`launcher_hung`)


def child_env(extra: Mapping[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env.update(extra)
    return env


class _Stop:
    """When a stop signal arrived (None: not yet); the deadline of the ranks' grace follows from it."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.at: Optional[float] = None

    def overdue(self) -> bool:
        return self.at is not None and time.monotonic() - self.at > self.grace_s


def run_subprocess(cmd: Command, run_dir: Path, grace_s: float, log: Optional[Path] = None, *,
                   announce: bool = True) -> int:
    """Run `cmd` in its own process group and supervise it (`supervise`) until it and everything it started have
    ended; with `log`, its output passes through `console.relay` (third-party noise goes to `log`). `announce`:
    this process names a lost node or a stall (False: the rank says it itself, `run_in_process`)."""
    mark = f"{os.getpid()}-{time.time_ns()}"  # (tree.MARK: what the launcher starts is ours, seen or not)
    _KILLED_ALONE.pop(run_dir.resolve(), None)
    _HUNG.pop(run_dir.resolve(), None)
    proc, relays = _start(dataclasses.replace(cmd, env={**cmd.env, MARK: mark}), log)
    stop, tree = _Stop(grace_s), Tree(proc.pid, mark)

    def forward(signum: int) -> None:
        stop.at = stop.at or time.monotonic()
        tree.signal(signum)

    code: Optional[int] = None
    try:
        with stopping.handling(on_signal=forward, announce=True):
            code = supervise(proc, run_dir, stop, announce, tree, rank=cmd.in_process)  # (not -9 where it stopped it)
    finally:  # (Ctrl-C twice too) whatever is still there: leftover workers, a stuck rank, a killed launcher's ranks
        tree.end()
        ended = proc.wait()
        for thread in relays:
            thread.join(timeout=10)  # a rank that outlives its launcher must not hold us here
    return ended if code is None else code


def _start(cmd: Command, log: Optional[Path]) -> Tuple[subprocess.Popen, List[threading.Thread]]:
    """Start `cmd` in a new session: ranks learn the progress mode (and the terminal width for a bar drawn through
    a pipe) and boundary/rank_env.RANK_DEFAULTS (torch's C++ warnings off the console) where the user set none."""

    columns = {"COLUMNS": str(shutil.get_terminal_size().columns)} if sys.stderr.isatty() else {}
    pipe = subprocess.PIPE if log is not None else None
    unbuffered = {"PYTHONUNBUFFERED": "1"} if pipe else {}  # ranks writing into a pipe would hold lines back
    env = child_env({**rank_defaults(os.environ), PROGRESS_ENV: progress_mode(), **columns, **unbuffered, **cmd.env})
    proc = subprocess.Popen(cmd.argv, env=env, stdout=pipe, stderr=pipe, start_new_session=True)
    relays = [] if log is None else [relay(proc.stdout, sys.stdout, log), relay(proc.stderr, sys.stderr, log)]
    return proc, relays


def supervise(proc: subprocess.Popen, run_dir: Path, stop: Optional[_Stop] = None, announce: bool = True,
              tree: Optional[Tree] = None, *, rank: bool = False) -> int:
    """Wait for the launcher (and, after a stop signal, for its whole tree, up to the grace). When a rank reports
    a lost node (<run>/failure.json, dsrecipes.core.heartbeat), say which node failed and give the launcher
    FAILED_NODE_GRACE_S to stop its ranks; then end its process tree (pdsh keeps waiting for ssh to a dead host, and
    deepspeed's own cleanup would ssh there too). `rank`: `proc` is the rank itself (a sweep's launcher=local job),
    whose death by a signal is the rank's (commands/outcome.py says it), not a launcher's."""
    stop, tree = stop or _Stop(0.0), tree or Tree(proc.pid)
    deadline: Optional[float] = None
    code: Optional[int] = None
    left = _LeftAlone(tree, exit_bound(proc.args))
    noted = 0.0  # seconds after the stop signal of the last waiting line
    while code is None or (stop.at is not None and tree.alive()):
        if stop.overdue():
            print(f"error: {tree.running()} did not stop within trainer.stop_grace_s={stop.grace_s:g} s "
                  "of the stop signal; killed (nothing after the last checkpoint is kept)", file=sys.stderr, flush=True)
            tree.end()  # out of time: whatever has not stopped is killed
            break
        if stop.at is not None and time.monotonic() - stop.at - noted >= STOP_NOTE_S:
            noted = time.monotonic() - stop.at
            print(f"dsrecipes: waiting {noted:.0f} s for {tree.running()} to save and stop (killed at "
                  f"trainer.stop_grace_s={stop.grace_s:g})", file=sys.stderr, flush=True)  # fmt: skip
        if code is not None:
            time.sleep(0.2)  # the launcher ended; its ranks are still saving
            continue
        try:
            code = proc.wait(timeout=0.5)
            if not rank:
                _launcher_lost(proc, code, stop, tree, run_dir)
            continue
        except subprocess.TimeoutExpired:
            pass
        if not rank and left.overdue():  # its ranks ended, the launcher did not (a rank's children are its own)
            kill_tree(proc.pid)
            code = proc.wait()  # (-9: this process's, not a rank's: `launcher_hung`)
            _HUNG[run_dir.resolve()] = (f"the launcher (pid {proc.pid}, {command_name(proc.args)}) did not exit "
                                        f"{left.bound_s:g} s after its ranks ended and was killed by dsrecipes")
            continue
        if deadline is None and (run_dir / heartbeat.FAILURE_FILE).is_file():
            deadline = time.monotonic() + FAILED_NODE_GRACE_S
        elif deadline is not None and time.monotonic() > deadline:
            kill_tree(proc.pid)
            proc.wait()
            code = stopped_code(run_dir)
    code = proc.wait() if code is None else code
    failure = heartbeat.read_failure(run_dir) if code != 0 else None
    # a lost node or a stall (a rank's own failure: outcome.py); a rank killed by a signal, which its peers then saw
    # stop responding, is outcome.py's one line too (it names the rank and the signal)
    hung = run_dir.resolve() in _HUNG  # (its -9 is this process's, not a rank's)
    if announce and failure is not None and "lost" in failure and (failure.get("stalled") or hung or not killed_by(code)):
        stopped = "Every rank was" if failure.get("stalled") else "The ranks on the other nodes were"
        print(f"error: {heartbeat.describe_failure(failure)}. {stopped} stopped; run the same command again to resume "
              "from the last checkpoint (trainer.resume=auto)", file=sys.stderr, flush=True)  # fmt: skip
    return code


LAUNCHER_EXIT_S = 20.0  # DeepSpeed's per-node launcher polls its ranks every second and exits after the last
# A multi-node torchrun agent whose ranks ended waits in its exit barrier for the other nodes' agents this long (torch's
# LaunchConfig.exit_barrier_timeout, no torchrun option): node 1's while node 0's rank 0 exports after the others ended
TORCHRUN_EXIT_BARRIER_S = 300.0


def exit_bound(argv: Any) -> float:
    """How long after its ranks ended the launcher `argv` may still be there: LAUNCHER_EXIT_S, and a multi-node
    torchrun agent's exit barrier on top (run/launch/builders.py writes `torch.distributed.run ... --nnodes N`)."""
    words = [str(w) for w in argv] if isinstance(argv, (list, tuple)) else []
    nodes = words[words.index("--nnodes") + 1] if "--nnodes" in words[:-1] else "1"
    return LAUNCHER_EXIT_S + (TORCHRUN_EXIT_BARRIER_S if "torch.distributed.run" in words and nodes != "1" else 0.0)


class _LeftAlone:
    """A launcher that does not exit after its ranks (and their workers) have all ended: stopped (SIGSTOP, a cgroup
    freezer) or stuck, it would keep the run waiting for ever with nothing on the console. Overdue
    `exit_bound` after its last child ended, said in one warning line; the caller then ends it (the ranks' own
    outcome says how the run went, `launcher_hung`)."""

    def __init__(self, tree: Tree, bound_s: float) -> None:
        self.tree, self.had_children, self.bound_s = tree, False, bound_s  # (exit_bound)
        self.since: Optional[float] = None

    def overdue(self) -> bool:
        try:
            state = psutil.Process(self.tree.pid).status()
            children = self.tree.look()  # (a zombie: a rank it never reaped, maybe one that ended before a poll saw it)
            live = [c for c in children if c.status() != psutil.STATUS_ZOMBIE]
        except psutil.Error:
            return False
        self.had_children = self.had_children or bool(children)
        if live or not self.had_children:
            self.since = None
            return False
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since < self.bound_s:
            return False
        print(f"warning: every rank has ended, but the launcher (pid {self.tree.pid}, state {state}) has not exited "
              f"{self.bound_s:g} s later; dsrecipes killed it (the ranks' own outcome decides how the run ended)",
              file=sys.stderr, flush=True)  # fmt: skip
        return True


def _launcher_lost(proc: subprocess.Popen, code: int, stop: _Stop, tree: Tree, run_dir: Path) -> None:
    """The launcher itself killed by a signal (DeepSpeed's per-node launcher, a torchrun agent: `kill -9` of the
    wrong pid) while its ranks train on: they are stopped like a SIGTERM stops them, at the next step boundary with a
    checkpoint, instead of being killed with the launcher's group and losing the steps since the last save. A
    launcher that ends because a rank died exits with a code (DeepSpeed's: 247 for a rank's SIGKILL), not a signal.
    No rank left to stop (torchrun's, killed as it started them: they ended with it): `killed_alone` says so."""
    name = killed_by(code) if code < 0 else None
    if name is None or stop.at is not None:
        return
    tree.gather()  # (ranks it started in the last poll's 0.5 s)
    lost = f"the launcher (pid {proc.pid}, {command_name(proc.args)}) was killed by {name}"
    if not tree.alive():
        _KILLED_ALONE[run_dir.resolve()] = f"{lost}; its ranks ended with it"
        return
    stop.at = time.monotonic()
    lost = f"{lost} while its ranks ran"
    stopping.stopped_for(lost)  # the run's outcome names this, not a SIGTERM nobody sent (commands/outcome.py)
    print(f"dsrecipes: {lost}; stopping them at the next step boundary with a checkpoint (up to "
          f"trainer.stop_grace_s={stop.grace_s:g} s)", file=sys.stderr, flush=True)  # fmt: skip
    tree.signal(signal.SIGTERM)


def killed_alone(run_dir: Path) -> Optional[str]:
    """How the launcher of the run in `run_dir` was killed by a signal with no rank of it left to stop, once (None
    where it was not): the run's cause, not a rank's signal (commands/outcome.py; the ranks were not stopped by this
    process: no stopping.cause)."""
    return _KILLED_ALONE.pop(Path(run_dir).resolve(), None)


def launcher_hung(run_dir: Path) -> Optional[str]:
    """How the launcher of the run in `run_dir` was killed by this process `exit_bound` after its ranks ended,
    once (None where it was not): its -9 is not a rank's; the ranks' own outcome decides the run (commands/outcome.py
    names this only where they left none)."""
    return _HUNG.pop(Path(run_dir).resolve(), None)


def stopped_code(run_dir: Path) -> int:
    """The exit code of a launcher this process had to stop after a rank reported a failure, or after its ranks
    ended (its SIGKILL is not the cause): 2 when that was a user error found by a rank (its own message: a rendezvous
    that timed out, bad data), else 1."""
    report = rank_failure(run_dir)
    return 2 if report is not None and report.get("render") else 1


def run_in_process(cmd: Command, run_dir: Path, grace_s: float) -> int:
    """launcher=local: the rank runs here. A stop signal is acted on by the rank itself (stopping.py); if it has not
    stopped `grace_s` after the signal, it is interrupted where it stands.

    The rank is the same module the other launchers start with `python -m` (plan.WORKER_MODULE), imported by that
    name only here, when it runs: the launching wing has no import of the rank wing (tests/test_architecture.py).

    A sweep's job (Hydra's multirun) runs its rank as a child process instead: `cmd` itself, the argv and
    environment launch.txt shows, supervised as the other launchers' (`run_subprocess`: output relayed, its process
    group ended, bounded waits). A rank that stalls ends its own process (core/heartbeat.py: os._exit; a thread stuck
    in a step cannot be ended otherwise), and here that would end the whole sweep, the later jobs and the summary
    with it; a child's stall, crash or exit ends its job only. The child still runs as launcher=local's rank (it
    prints its failure and writes result.json itself), so this process does not say it again."""
    if _in_sweep():
        return run_subprocess(cmd, run_dir, grace_s, log_path(run_dir, "launcher"), announce=False)
    worker = importlib.import_module(WORKER_MODULE)

    timers: List[threading.Timer] = []

    def deadline(signum: int) -> None:
        if not timers:
            timers.append(threading.Timer(grace_s, _interrupt_main, (grace_s, signum)))
            timers[0].daemon = True
            timers[0].start()

    saved = {k: os.environ.get(k) for k in cmd.env}
    os.environ.update(cmd.env)
    try:
        with stopping.handling(on_signal=deadline, announce=True):
            result = worker.run_rank(run_dir)
    finally:
        for timer in timers:
            timer.cancel()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return result


def _interrupt_main(grace_s: float, signum: int) -> None:
    """The local rank did not stop within its grace: a real SIGINT to the main thread, which stopping.py's handler
    (told by `stop_now`) turns into `Stopped(signum)` there: the run ends as `signum`'s interruption (143 for
    SIGTERM), saying it was stopped at the grace, not "by a second SIGINT". `_thread.interrupt_main` only flags it,
    and a main thread blocked in a system call (a pipe read from a frozen DataLoader worker) never looked at the flag."""
    print(f"error: the rank did not stop within trainer.stop_grace_s={grace_s:g} s of the stop signal; stopping it "
          "where it stands (nothing after the last checkpoint is kept)", file=sys.stderr, flush=True)  # fmt: skip
    stopping.stop_now(f"interrupted by {signal.Signals(signum).name}; the rank did not stop within "
                      f"trainer.stop_grace_s={grace_s:g} s and was stopped where it stood")
    main = threading.main_thread().ident
    if main is None:
        _thread.interrupt_main()
        return
    signal.pthread_kill(main, signal.SIGINT)


def _in_sweep() -> bool:
    from dsrecipes.observe.sweep import in_sweep  # lazy: else `process` (the ds_node entry point) imports hydra 0.12 s

    return in_sweep()
