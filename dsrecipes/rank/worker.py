"""Per-rank entry point: `python -m dsrecipes.rank.worker --run-dir RUN` (under deepspeed, torchrun, mpirun or srun).

Reads the run directory the launching process wrote (config.yaml + ds_config.json) and never re-composes Hydra,
so every rank trains exactly the resolved config. The local launcher calls `run(run_dir)` in-process instead.

A rank process starts with Python's cyclic garbage collector off: its start-up imports (torch, transformers,
DeepSpeed: ~1M objects that stay alive) triggered full collections walking all of them, ~1.3 of a rank's ~7 CPU s
of start-up on the 2-core test machine. `train.collector_on()` freezes what start-up left (gc.freeze: never walked
again) and turns the collector on once the session is built, before the first step and the first DataLoader fork.

A rank that trained to the end does what interpreter shutdown does that anything outside the process can see - its
other non-daemon threads joined, the atexit handlers run (logging's, multiprocessing's, the trackers'), the console
flushed - and then ends with os._exit(0) (`end_trained_rank`): the module-by-module teardown of torch, transformers
and DeepSpeed that would follow is skipped, 1.3-1.6 s of wall time between a rank's last atexit handler and its end
on the loaded 2-core test machine, at the end of every run.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # a rank process: no cyclic collector while it starts (train.collector_on turns it on)
    gc.disable()

import argparse  # noqa: E402
import atexit  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Iterator, List, Optional  # noqa: E402

import dsrecipes.boundary.trust as trust  # noqa: E402
import dsrecipes.core.heartbeat as heartbeat  # noqa: E402
from dsrecipes.boundary.checkpoint_find import committed  # noqa: E402
from dsrecipes.config.load import load_run_config  # noqa: E402
from dsrecipes.core.console import exit_flushed, log_path, quiet_third_party, survive_lost_console  # noqa: E402
from dsrecipes.core.errors import RunInterrupted, TrainingFailed, UserError  # noqa: E402
from dsrecipes.core.failure import log_traceback, record_rank_failure  # noqa: E402
from dsrecipes.core.locks import is_held, probe_held  # noqa: E402
from dsrecipes.core.rundir import CHECKPOINTS_DIR, LOCK_FILE  # noqa: E402
from dsrecipes.core.runplan import node_lock, read_plan, reported_by_launcher  # noqa: E402
from dsrecipes.core.schema import Device  # noqa: E402
from dsrecipes.data.strategies.base import end_workers, worker_lost  # noqa: E402
from dsrecipes.rank.checkpoint import TrainState  # noqa: E402
from dsrecipes.rank.train import train  # noqa: E402

LAUNCHER_POLL_S = 1.0
STORE_ASK_S = 5.0  # a rank that cannot record its failure asks the job's store this long whether another said it


def run(run_dir: str | Path) -> TrainState:
    """Train the run in `run_dir` as the rank described by the environment (RANK, WORLD_SIZE, ...). Exports (a reward
    model) load as the launching process accepted them (plan.json; boundary/trust.launched), checked where they load."""

    with trust.launched(read_plan(run_dir).exports):
        cfg = load_run_config(run_dir)
        if cfg.trainer.device is Device.cpu:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the first `import deepspeed`

        try:
            return train(cfg, run_dir)
        except UserError:
            raise
        except Exception:
            heartbeat.explain_crash()  # a broken collective because a node died: name the node (exits) or re-raise
            raise


def run_rank(run_dir: str | Path) -> int:
    """`run()`, as an exit code: 0 when it trained to the end, the signal's code (130/143) when it stopped on
    SIGINT/SIGTERM, 1 when training failed (non-finite loss; the ranks wrote why into rank_outcome.json). Any other
    failure (an exception in the loop, in a DataLoader worker, in evaluation, checkpointing or export; a user error
    found by the rank) ends this rank's DataLoader workers at once and is recorded as one line (`failed`)."""
    try:
        run(run_dir)
    except RunInterrupted as exc:
        return exc.exit_code
    except TrainingFailed as exc:  # every rank meets it (an all-reduced verdict; the export's: rank 0): said once
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - every other way out is one recorded line, never a hang
        return failed(run_dir, exc)
    finally:  # every way out, Ctrl-C twice included: an iterator still referenced (a traceback, a stop) would have
        end_workers()  # its workers (they ignore SIGTERM) joined forever at exit; a loader left mid-epoch too
    return 0


def failed(run_dir: str | Path, exc: BaseException) -> int:
    """A failing rank: its workers are SIGKILLed (they ignore SIGTERM), the traceback goes to its log, the one-line
    cause into <run>/failure.json (first rank wins) for the launching process; returns the exit code."""
    lost = worker_lost(None, exc)  # torch's SIGCHLD handler raises wherever the rank was: name the worker
    if lost is not None:
        lost.__traceback__ = exc.__traceback__
        exc = lost
    end_workers()
    rank = int(os.environ.get("RANK", "0"))
    log = log_path(Path(run_dir), f"rank{rank}")
    log_traceback(log, exc)
    report = record_rank_failure(Path(run_dir), rank, exc, log)
    if report.get("disk_full"):  # not recorded: said by this rank, once for the job
        says = first_unrecorded(run_dir)
    else:  # said by the launching process where it reads failure.json; the first rank recorded says it otherwise
        says = report.get("pid") == os.getpid() and (report.get("unrecorded") or not reported_by_launcher(Path(run_dir)))
    if says:
        print(report["render"] or f"error: {report['reason']} {_where_said(report, run_dir, log)}", file=sys.stderr,
              flush=True)
    return exc.exit_code if isinstance(exc, UserError) else 1


def first_unrecorded(run_dir: str | Path) -> bool:
    """Whether this rank, which could not record its failure on a full disk, is the first of the job's ranks to say
    so, by a count in the job's store (core/heartbeat.py): the others failed on the same disk or because that rank
    ended (a collective's peer gone), and the console says it once. A store that is gone or does not answer within
    STORE_ASK_S means its host ended (launcher=deepspeed: rank 0, which asked first); without one (no heartbeat)
    every such rank says it."""
    beat = heartbeat.stopped()  # (rank/train stops it before the failure reaches here)
    if beat is None or beat.world_size < 2 or beat.run_dir != Path(run_dir) or not hasattr(beat, "store"):
        return True  # a lone rank, or this run's heartbeat never started
    try:
        with _native_stderr_quiet():  # torch's store client prints a C++ stack of its own when the store is gone
            beat.store.set_timeout(timedelta(seconds=STORE_ASK_S))
            return int(beat.store.add(f"{beat.prefix}/unrecorded", 1)) == 1
    except Exception:  # noqa: BLE001 - the store's host is gone (connection reset, refused) or silent
        return False


@contextlib.contextmanager
def _native_stderr_quiet() -> Iterator[None]:
    """File descriptor 2 to /dev/null for a moment (what native code writes there; this process's own lines are
    flushed before and printed after)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _where_said(report: dict, run_dir: str | Path, log: Path) -> str:
    """Where the rest is: the traceback's log, or, on a full disk, nowhere (the launching process then says nothing
    more: commands/outcome.report_unexplained)."""
    if not report.get("disk_full"):
        return f"(traceback: {log})"
    newest = committed(Path(run_dir) / CHECKPOINTS_DIR)
    then = f"to resume from {newest[0]}" if newest else "(no checkpoint yet: it starts from step 1)"
    return (f"(the disk of {run_dir} is full: neither this failure, its traceback nor result.json could be written "
            f"there); free space, then run the same command again {then}")


def watch_launcher(run_dir: Path) -> None:
    """A rank whose supervisor died (even by SIGKILL: its lock is gone) stops as on SIGTERM - checkpoint at the next
    step boundary, all ranks alike - and is gone trainer.stop_grace_s later whatever it was doing (stuck in a
    collective): no rank outlives its run for longer. The supervisor: on the launching process's node its lock on
    the run directory; on a node > 0 started by `dsrecipes node`, that process's node lock (runplan.node_lock).
    Nothing is watched where the lock is not seen held at the start (a file system without locks)."""
    node = os.environ.get("CROSS_RANK") or os.environ.get("GROUP_RANK") or "0"
    try:
        with trust.launched(read_plan(run_dir).exports):
            grace = float(load_run_config(run_dir).trainer.stop_grace_s)
        lock = node_lock(run_dir)
        if lock is not None:
            path, who = lock, f"this node's `dsrecipes node` ({lock.name})"
        else:
            path, who = Path(run_dir) / LOCK_FILE, "the launching process"
        watched = (lock is not None or (node == "0" and reported_by_launcher(run_dir))) and is_held(path)
    except Exception:  # noqa: BLE001 - a run directory the rank cannot read fails in run() with its message
        return
    if not watched:
        return

    def watch() -> None:
        rank, unsure = os.environ.get("RANK", "0"), None  # unsure: since when the lock could not be probed
        while (held := probe_held(path)) is not False:
            if held is None and unsure is None:
                unsure = time.monotonic()
                print(f"dsrecipes: rank {rank}: cannot tell whether {who} is alive (probing "
                      f"{path} failed); training on, probing every {LAUNCHER_POLL_S:g} s", file=sys.stderr,
                      flush=True)
            elif held and unsure is not None:
                print(f"dsrecipes: rank {rank}: {who} is seen alive again after "
                      f"{time.monotonic() - unsure:.0f} s", file=sys.stderr, flush=True)
                unsure = None
            time.sleep(LAUNCHER_POLL_S)
        print(f"dsrecipes: rank {rank}: {who} is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace + 5)
        _exit_now(143)

    threading.Thread(target=watch, name="dsrecipes-launcher-watch", daemon=True).start()


THREADS_JOIN_S = 30.0  # a trained rank's wait for its other non-daemon threads (a tracker's upload) at the end


def end_trained_rank() -> None:
    """End a rank process that trained to the end: threads joined and atexit handlers run as at interpreter
    shutdown, then os._exit(0) without the teardown of every module (see the module docstring)."""
    rank, deadline = os.environ.get("RANK", "0"), time.monotonic() + THREADS_JOIN_S
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))  # bounded, unlike the interpreter's own join
            if thread.is_alive():
                print(f"dsrecipes: rank {rank}: thread {thread.name} did not end within {THREADS_JOIN_S:g} s of the "
                      "end of training; the rank ends without it", file=sys.stderr, flush=True)
    atexit._run_exitfuncs()
    _exit_now(0)


def _exit_now(code: int) -> None:
    """End a failed rank process without interpreter shutdown (nothing left to join: workers, feeder threads)."""
    exit_flushed(code)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsrecipes.rank.worker", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory written by `python -m dsrecipes`")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    log = log_path(Path(args.run_dir), f"rank{os.environ.get('RANK', '0')}")
    quiet_third_party(log)  # before deepspeed loads
    survive_lost_console(log)
    watch_launcher(Path(args.run_dir))
    return run_rank(args.run_dir)


if __name__ == "__main__":
    # A rank process that failed ends without interpreter shutdown (nothing left to join); main() itself returns,
    # so a caller in its own process (a test, a requeued job's step) is never ended by it.
    _code = main()
    gc.freeze()  # the interpreter's last collections skip what is still alive (~1 CPU s with torch loaded)
    if _code not in (0, 130, 143):
        _exit_now(_code)
    if _code == 0:
        end_trained_rank()
    raise SystemExit(_code)
