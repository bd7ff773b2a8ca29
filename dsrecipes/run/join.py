"""A node > 0 of a multi-node run without ssh (`dsrecipes node RUN --node-rank N`, launch/multinode_nossh.sh):
wait for node 0 to have written this attempt's run directory, then start and supervise this node's ranks.

Nothing node 0 wrote is executed: `launch.txt` stays a record for people. This node reads the run's resolved config
the way its ranks read it (`config.load.load_run_config`, with the exports plan.json accepted), sets
`launcher.node_rank`, builds the commands with node 0's `build_plan` (multi-node: launcher.master_port or 29500, the
same on every node) and runs its own with node 0's supervision (`process.run_subprocess`: output relayed, the
launcher's tree followed, stop signals forwarded, trainer.stop_grace_s, nothing left behind).

When is the run directory this attempt's? Node 0's launching process holds `<run>/.dsrecipes.lock` (an flock, gone
with the process, even on SIGKILL) for the whole run, and rewrites that file (its holder: pid, host, time) when it
takes it; it writes `launch.txt` last, after config.yaml, plan.json and ds_config.json. So the directory is ready
when (1) `launch.txt` is not older than the lock file (one from an earlier attempt predates this attempt's lock, and
the release of an earlier one), (2) the lock is held now (`rundir.launcher_alive`, what the ranks ask too; probed
only once (1) holds: a probe holds the lock for an instant, and node 0's claim in that instant would be refused),
and (3) there is no `failure.json` (node 0 removes an earlier attempt's right after writing launch.txt; a newer one
is this attempt's failure: node 1 waits for the next attempt). Both times are stamped by node 0's writes to the
same storage, so no clock of this node is compared with node 0's, and node 0 may be ahead of this node or behind it:
there is nothing to sleep for. Files are opened before they are stat'ed, so an NFS client revalidates what it cached.
A dry run of node 0 is not joined. While this node's ranks run, `dsrecipes node` holds `<run>/.dsrecipes.nodeN.lock`:
another one for the same node rank (NODE_RANK given twice, or the previous attempt's still ending) waits for it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import List, Optional, Set, Tuple

import dsrecipes.boundary.trust as trust
import dsrecipes.core.stopping as stopping
from dsrecipes.config.load import load_run_config
from dsrecipes.core.console import LOGS_DIR, log_path, quiet_third_party
from dsrecipes.core.distributed import remove_shm_buffers
from dsrecipes.core.errors import UserError
from dsrecipes.core.failure import killed_by, rank_failure
from dsrecipes.core.heartbeat import FAILURE_FILE
from dsrecipes.core.locks import ExclusiveLock, LockHeld, describe_holder, is_held
from dsrecipes.core.rundir import LOCK_FILE, RESULT_FILE, launcher_alive
from dsrecipes.core.runplan import NODE_LOCK, NODE_LOCK_ENV, read_plan
from dsrecipes.core.schema import LauncherKind, TrainConfig
from dsrecipes.run.launch import build_plan, resolve_master_port
from dsrecipes.run.launch.plan import LAUNCH_FILE, Command
from dsrecipes.run.launch.process import launcher_hung, run_subprocess

NOTE_S = 30.0  # a console line this often while this node waits for node 0
POLL_S = 0.5
MULTINODE = (LauncherKind.deepspeed_multinode, LauncherKind.torchrun)


def join(run_dir: Path, node_rank: int, wait_s: float) -> int:
    """Wait for node 0, start this node's ranks, supervise them; one line at the end. Returns the exit code."""
    run_dir = Path(run_dir).expanduser().resolve()
    if node_rank == 0:
        raise UserError("--node-rank 0: node 0 runs the launching process itself (launch/multinode_nossh.sh with "
                        "NODE_RANK=0, or `python -m dsrecipes ... launcher.node_rank=0`); `dsrecipes node` is for "
                        "nodes 1 and up")
    stopping.reset()
    wait_for_launch(run_dir, node_rank, wait_s)
    cfg = node_config(run_dir, node_rank)
    commands = node_commands(cfg, run_dir)
    claim = claim_node(run_dir, node_rank)
    try:
        log = log_path(run_dir, f"launcher-node{node_rank}")
        quiet_third_party(log)  # (as node 0's launching process: its ranks inherit the same quiet bars)
        print(f"node {node_rank}: starting its ranks ({_describe(cfg)}); its launcher's output is also in {log}",
              file=sys.stderr, flush=True)
        named = {NODE_LOCK_ENV: str(run_dir / NODE_LOCK.format(node_rank))}  # its ranks watch it (rank/worker.py)
        code = run_commands(cfg, run_dir, [dataclasses.replace(c, env={**c.env, **named}) for c in commands], log)
    finally:
        claim.release()
    return conclude(run_dir, node_rank, code, log)


def claim_node(run_dir: Path, node_rank: int) -> ExclusiveLock:
    """This node's place in the run, held while its ranks run (<run>/.dsrecipes.nodeN.lock): a second `dsrecipes
    node` with the same --node-rank (a copy-paste of NODE_RANK, or one left from an earlier attempt still ending)
    waits for it (wait_for_launch) rather than starting ranks of the same node rank twice (a rendezvous that never
    completes); one that takes it at the same instant is refused."""
    try:
        return ExclusiveLock(run_dir / NODE_LOCK.format(node_rank), {"node_rank": node_rank}).acquire()
    except LockHeld as exc:
        raise UserError(f"--node-rank {node_rank}: node {node_rank} of {run_dir} is already running ({exc.holder}); "
                        "every node joins with its own NODE_RANK (1 to NNODES-1)") from None
    except OSError as exc:
        raise UserError(f"cannot lock {run_dir / NODE_LOCK.format(node_rank)} ({exc.strerror or exc})") from None


def wait_for_launch(run_dir: Path, node_rank: int, wait_s: float) -> None:
    """Until `ready` and no other `dsrecipes node` runs this node rank's ranks (a line at the start and every NOTE_S
    saying for what); UserError naming it after `wait_s`."""
    started, noted, dead = time.monotonic(), -NOTE_S, set()
    while True:
        missing = ready(run_dir, dead)
        other = _other_joiner(run_dir, node_rank) if missing is None else None
        if missing is None and other is None:
            return
        waited = time.monotonic() - started
        if waited >= wait_s:
            raise UserError(_gave_up(run_dir, node_rank, wait_s, missing, other))
        missing = missing or other
        if waited - noted >= NOTE_S:
            noted = waited
            print(f"node {node_rank}: waiting for {missing} ({waited:.0f} s of {wait_s:g} s)", file=sys.stderr,
                  flush=True)
        time.sleep(min(POLL_S, max(0.0, wait_s - waited)))


def _gave_up(run_dir: Path, node_rank: int, wait_s: float, missing: Optional[str], other: Optional[str]) -> str:
    """The message at the bound: what never came, and what to do about it."""
    head = f"node {node_rank}: waited {wait_s:g} s (--wait-s, WAIT_S) for"
    if other is not None:
        return (f"{head} {other}; nothing was started on this node. Give every node its own NODE_RANK (1 to "
                "NNODES-1), or wait for that one to end")
    if not run_dir.is_dir():
        return (f"{head} {missing}; nothing was started on this node, and {run_dir} does not exist here: RUN_DIR must "
                "be on storage every node sees at the same path. Start node 0 (NODE_RANK=0) with that RUN_DIR")
    locks = (f" (node 0's launching process holds {run_dir / LOCK_FILE} while it runs, which a filesystem that shares "
             "no file locks between nodes does not show)") if not _alive(run_dir) else ""
    return (f"{head} {missing}{locks}; nothing was started on this node. Start node 0 (NODE_RANK=0) with the same "
            "RUN_DIR, or give it longer to prepare the data")


def ready(run_dir: Path, dead: Optional[Set[Tuple[Optional[int], Optional[int]]]] = None) -> Optional[str]:
    """None when node 0's launching process of this attempt has written the run directory, else what is missing
    (see the module's docstring). The lock is probed only once launch.txt is not older than it (node 0 then holds
    it already), and not again for the same two times once found free (`dead`, the caller's): a probe holds the
    lock for an instant, and node 0's claim of the run directory taken in that instant is refused as 'in use'."""
    launch_file = run_dir / LAUNCH_FILE
    times = _times(run_dir)
    missing = _unwritten(launch_file, *times)
    if missing is not None:
        return missing
    if (dead is not None and times in dead) or not launcher_alive(run_dir):
        if dead is not None:
            dead.add(times)
        result = _mtime(run_dir / RESULT_FILE)
        if result is not None and result >= times[1]:  # (node 1 came after the run: it waits for the next attempt)
            return f"node 0's next attempt (the last one has ended: {run_dir / RESULT_FILE})"
        return f"node 0 to write {launch_file} (no launching process holds {run_dir / LOCK_FILE} now)"
    times = _times(run_dir)  # (again after the probe: a claim taken meanwhile)
    missing = _unwritten(launch_file, *times)
    if missing is not None:
        return missing
    failure = _mtime(run_dir / FAILURE_FILE)
    if failure is not None and failure < times[1]:
        return f"node 0 to remove {run_dir / FAILURE_FILE} of an earlier attempt"
    if failure is not None:  # (this attempt's: the run is coming down, ranks started now would only be stopped)
        return f"node 0's next attempt (this one failed: {run_dir / FAILURE_FILE})"
    return None


def _other_joiner(run_dir: Path, node_rank: int) -> Optional[str]:
    """What another `dsrecipes node` of this node rank holds (an earlier attempt's, still ending its ranks; or a
    NODE_RANK given twice), else None. A probe: nothing is created."""
    path = run_dir / NODE_LOCK.format(node_rank)
    if _mtime(path) is None or not is_held(path):
        return None
    return f"the other `dsrecipes node --node-rank {node_rank}` of {run_dir} to end ({describe_holder(path)})"


def _times(run_dir: Path) -> Tuple[Optional[int], Optional[int]]:
    """(the lock file's, launch.txt's) modification times."""
    return _mtime(run_dir / LOCK_FILE), _mtime(run_dir / LAUNCH_FILE)


def _unwritten(launch_file: Path, held_since: Optional[int], written: Optional[int]) -> Optional[str]:
    if written is None or held_since is None:
        return f"node 0 to write {launch_file}"
    if written < held_since:
        return f"node 0 to write {launch_file} (the one there is from an earlier attempt)"
    return None


def _mtime(path: Path) -> Optional[int]:
    """`path`'s modification time (ns), None when it is missing or no regular file (a FIFO on shared storage would
    hold a lock probe's open for ever); opened first (NFS close-to-open revalidation), never through a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        return info.st_mtime_ns if stat.S_ISREG(info.st_mode) else None
    finally:
        os.close(fd)


def _alive(run_dir: Path) -> bool:
    """rundir.launcher_alive, where the lock is a regular file."""
    return _mtime(run_dir / LOCK_FILE) is not None and launcher_alive(run_dir)


def node_config(run_dir: Path, node_rank: int) -> TrainConfig:
    """The run's resolved config as its ranks read it, as node `node_rank`; refused (UserError) unless the run is a
    multi-node run without ssh that has such a node."""
    with trust.launched(read_plan(run_dir).exports):  # (as rank/worker.run reads it)
        cfg = load_run_config(run_dir)
    ln = cfg.launcher
    if ln.kind not in MULTINODE or ln.num_nodes < 2:
        raise UserError(f"{run_dir} is a run of launcher={ln.kind.value} with launcher.num_nodes={ln.num_nodes}: its "
                        "launching process starts every rank itself. `dsrecipes node` joins runs of "
                        "launcher=deepspeed_multinode or launcher=torchrun with launcher.num_nodes > 1")
    if not 0 < node_rank < ln.num_nodes:
        raise UserError(f"--node-rank {node_rank}: {run_dir} is a run of {ln.num_nodes} nodes (node ranks 0 to "
                        f"{ln.num_nodes - 1}; node 0 is the launching process's)")
    if ln.dry_run:
        raise UserError(f"{run_dir} is a dry run (launcher.dry_run=true): node 0 wrote its commands and started no "
                        "rank; nothing to join. Start node 0 without launcher.dry_run")
    return dataclasses.replace(cfg, launcher=dataclasses.replace(ln, node_rank=node_rank))


def node_commands(cfg: TrainConfig, run_dir: Path) -> List[Command]:
    """This node's commands of node 0's plan (torchrun: the one every node runs), built from the typed config."""
    plan = build_plan(cfg, run_dir, master_port=resolve_master_port(cfg))  # (multi-node: never a free-port pick)
    missing = [f"launcher.kind={cfg.launcher.kind.value}: {r.name} not found ({r.why})" for r in plan.requires
               if r.missing()]  # fmt: skip
    if missing:
        raise UserError(missing)
    for warning in plan.warnings:  # (this node's environment: CUDA_VISIBLE_DEVICES)
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    mine = [c for c in plan.commands if c.node_rank in (None, cfg.launcher.node_rank)]
    if not mine or any(c.in_process for c in mine):  # (no multi-node builder makes either)
        raise UserError(f"{run_dir}: launcher={cfg.launcher.kind.value} has no command for node "
                        f"{cfg.launcher.node_rank}")
    return mine


def run_commands(cfg: TrainConfig, run_dir: Path, commands: List[Command], log: Path) -> int:
    """Node 0's supervision for this node's commands; their shared-memory segments go when they end."""
    code = 0
    try:
        for cmd in commands:
            code = run_subprocess(cmd, run_dir, cfg.trainer.stop_grace_s, log)
            if code != 0:
                break
    finally:
        remove_shm_buffers(resolve_master_port(cfg))  # (this machine's ranks have ended, as on node 0)
    return code


def conclude(run_dir: Path, node_rank: int, code: int, log: Path) -> int:
    """One line: how this node's ranks ended and where their output is; node 0 writes result.json and says how the
    run ended. Returns this process's exit code."""
    signum = stopping.requested()
    where = f"This node's launcher output: {log}; every rank's log: {run_dir / LOGS_DIR}/"
    if code == 0:
        print(f"node {node_rank}: its ranks finished (exit 0); the run's outcome is node 0's ({run_dir}/result.json). "
              f"{where}", file=sys.stderr, flush=True)
        return 0
    if signum is not None:
        print(f"node {node_rank}: stopped by {signal.Signals(signum).name}; its ranks stopped with the run at a step "
              f"boundary (node 0 says where and how to resume). {where}", file=sys.stderr, flush=True)
        return stopping.exit_code(signum)
    hung = launcher_hung(run_dir)  # (its -9 is this process's kill, not a rank's)
    killed = killed_by(code) if code < 0 and not hung else None
    how = f"its launcher was killed by {killed}" if killed else f"its ranks ended with exit code {code}"
    if hung:  # (how the ranks ended is node 0's to say: its result.json)
        how, code = hung, 1
    if stopping.cause():  # (process.py stopped the ranks itself: their launcher was killed)
        how = f"{stopping.cause()}; they were stopped at a step boundary with the run"
    report = rank_failure(run_dir)
    cause = f"; the run's first failure: {report.get('reason')}" if report and report.get("reason") else ""
    print(f"node {node_rank}: {how}{cause}; {_node_0_now(run_dir)}. {where}", file=sys.stderr, flush=True)
    return 128 - code if code < 0 else code


def _node_0_now(run_dir: Path) -> str:
    """Where the run's outcome is: node 0's result.json, unless node 0's launching process is gone without writing
    one for this attempt (its machine lost, or killed): then nobody will, and the run resumes from node 0."""
    result, launched = _mtime(run_dir / RESULT_FILE), _mtime(run_dir / LAUNCH_FILE)
    if _alive(run_dir) or (result is not None and launched is not None and result >= launched):
        return f"node 0 says how the run ended ({run_dir / RESULT_FILE})"
    return (f"node 0's launching process is gone too, without a {RESULT_FILE} for this attempt (its machine lost, or "
            "killed): start node 0 again with the same RUN_DIR to resume from the last checkpoint, and this node with "
            "the same command")


def _describe(cfg: TrainConfig) -> str:
    ln = cfg.launcher
    return f"launcher={ln.kind.value}, node {ln.node_rank} of {ln.num_nodes}, master {ln.master_addr}"
