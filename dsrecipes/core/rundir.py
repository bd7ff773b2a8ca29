"""The run directory: owning and locking it, what the launching process writes for the ranks, what a run leaves.

    dsrecipes_run.json   the ownership marker: dsrecipes created this directory (run id, config fingerprint)
    .dsrecipes.lock      held (flock) by the launching process for the whole run; names its holder
    .dsrecipes.ranks.lock  held shared by every rank while it runs (ranks that outlive a killed launcher count)
    config.yaml     the resolved TrainConfig (ranks read it; never re-composed)
    plan.json       the run plan (runplan.py)
    ds_config.json  the DeepSpeed dict for the plan's world size (ds_config.py)
    launch.txt      the launch commands (launch/)
    metrics.jsonl   train/eval lines (metrics.py)
    rank_outcome.json, rank_steps/  how the ranks ended, each rank's count of its steps (rank_records.py)
    result.json     status and headline numbers, for people and sweep summaries (sweep.py)

Ownership: a path the user names is theirs until proven ours. `claim()` writes only into a new directory, an empty
one, or one holding our marker, and refuses anything else (exit 2, nothing touched); everything dsrecipes deletes
later lives inside a directory it owns. Every file goes through the one atomic-write helper (fileio.py).
`run_summary()` is the one place that turns metrics.jsonl into headline numbers, for result.json and sweep tables.
"""

from __future__ import annotations

import os
import resource
import sys
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import (
    atomic_write_json,
    atomic_write_text,
    dangling_link_problem,
    missing_dirs,
    read_json_file,
    remove_empty_dirs,
)
from dsrecipes.core.locks import ExclusiveLock, LockHeld, SharedLock, probe_free, probe_held
from dsrecipes.core.metrics_file import METRICS_FILE, read_metrics, run_summary  # noqa: F401 - (re-exported)

CONFIG_FILE = "config.yaml"
DS_CONFIG_FILE = "ds_config.json"
RESULT_FILE = "result.json"
MARKER_FILE = "dsrecipes_run.json"
LOCK_FILE = ".dsrecipes.lock"
RANKS_LOCK_FILE = ".dsrecipes.ranks.lock"
SWEEP_MARKER = "dsrecipes_sweep.json"  # a sweep directory of ours (claim_sweep_dir)
CHECKPOINTS_DIR = "checkpoints"  # (checkpoint.py owns what is inside)
HYDRA_SUBDIR = ".hydra"  # Hydra writes it into a job directory before the job starts
# The remedy of a directory that is not ours (`ensure_owned_dir`): train's; a pipeline's stage, which does not choose
# its directory, is refused with the pipeline's (run/pipeline.py sets it around each stage)
FOREIGN_REMEDY: ContextVar[str] = ContextVar("FOREIGN_REMEDY", default="Choose another directory; nothing was changed")
CLAIMING_PREFIXES = (".dsrecipes", f".{MARKER_FILE}.")  # lock files, write probes, the marker being written
# Files of a run directory someone else may have handed over (or a damaged one) are read within bounds:
MAX_DS_CONFIG_BYTES = 1 << 20  # ds_config.json is a few KB


# ---------------------------------------------------------------------------------------------------------------
# Owning and locking


@dataclass
class Claim:
    """A run directory this process owns and holds locked until `release()` (or the end of a `with`)."""

    run_dir: Path
    fresh: bool  # created (or found empty) by this claim
    lock: ExclusiveLock
    made: Tuple[Path, ...] = ()  # the directories this claim created, deepest first

    def release(self) -> None:
        self.lock.release()

    def undo(self) -> None:
        """Release, and take back what a fresh claim wrote (the marker and lock files) and the directories it made
        while they hold nothing else: a run refused before it starts leaves no directory behind. A directory that
        was there before, or holds anything else, stays."""
        self.release()
        if not self.fresh:
            return
        for name in (MARKER_FILE, LOCK_FILE, RANKS_LOCK_FILE):
            (self.run_dir / name).unlink(missing_ok=True)
        remove_empty_dirs(self.made)

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

def claim(run_dir: Path, key: str, fingerprint: str, *, hydra_job_dir: bool = False) -> Claim:
    """Own and lock `run_dir` for one run: create it (or take it empty), or take an existing dsrecipes run.

    Anything else raises UserError naming `key` (the setting that chose the path) with nothing changed: a file, a
    path below a file, an unwritable place, a non-empty directory without our marker, a directory another run holds
    (its holder named), or one where ranks of an earlier run are still alive. `hydra_job_dir`: Hydra has already
    written its `.hydra/` into it (a sweep's job directory), which does not make it foreign. Two processes claiming
    the same new directory at once: one gets it, the other is told who holds it.
    """
    run_dir = Path(run_dir)
    made = tuple(missing_dirs(run_dir))
    ensure_owned_dir(run_dir, key, hydra_job_dir=hydra_job_dir)
    lock = ExclusiveLock(run_dir / LOCK_FILE, {"run_dir": str(run_dir)})
    try:
        lock.acquire()
    except LockHeld as exc:
        raise UserError(f"{key}: {run_dir} is in use by another run: {exc.holder}. One run at a time per "
                        "directory: wait for it, stop it, or choose another directory") from None
    except OSError as exc:
        raise UserError(f"{key}: cannot lock {run_dir} ({exc.strerror or exc})") from None
    ranks = probe_free(run_dir / RANKS_LOCK_FILE)
    if ranks is not None:
        lock.release()
        raise UserError(f"{key}: ranks of an earlier run in {run_dir} are still running ({ranks}); "
                        "stop them before starting another run there")
    fresh = not (run_dir / MARKER_FILE).is_file()  # only the lock holder writes the marker
    if fresh:
        marker = {"dsrecipes_run": 1, "run_id": uuid.uuid4().hex, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "config_fingerprint": fingerprint}
        atomic_write_json(run_dir / MARKER_FILE, marker)
    return Claim(run_dir, fresh, lock, made)


def ensure_owned_dir(run_dir: Path, key: str, *, hydra_job_dir: bool = False) -> bool:
    """Create `run_dir` or check that it is ours or empty. True when it already holds a dsrecipes run (marker).
    Names only dsrecipes itself writes while claiming (lock files, the marker being written) count as empty."""
    refuse_dangling_link(run_dir, key)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{key}: {run_dir} is a file, not a directory; choose a directory for the run")
    if not run_dir.exists():
        make_dir(run_dir, key)
        return False
    entries = {e for e in os.listdir(run_dir) if not e.startswith(CLAIMING_PREFIXES)}
    entries -= {HYDRA_SUBDIR} if hydra_job_dir else set()
    if MARKER_FILE in entries:
        read_marker(run_dir, key)
        _check_no_links(run_dir, key)
        check_writable(run_dir, key)
        return True
    if entries:
        shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
        raise UserError(f"{key}: {run_dir} is not empty ({shown}) and is not a dsrecipes run directory (no "
                        f"{MARKER_FILE}); dsrecipes writes only into a new or empty directory or one of its own runs. "
                        f"{FOREIGN_REMEDY.get()}")
    check_writable(run_dir, key)
    return False


def make_dir(path: Path, key: str) -> None:
    refuse_dangling_link(path, key)
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{key}: {path} lies below {parent}, which is a file")
            break
    try:
        path.mkdir(parents=True)
    except FileExistsError:  # another process made it meanwhile: treat it like any existing directory
        if not path.is_dir():  # something else appeared there meanwhile: refused, never a loop of retries
            raise UserError(f"{key}: cannot create {path} (something other than a directory is there)") from None
        ensure_owned_dir(path, key)
    except OSError as exc:
        raise UserError(f"{key}: cannot create {path} ({exc.strerror or exc})") from None


def refuse_dangling_link(path: Path, key: str) -> None:
    """A symbolic link to nothing at `path` or above it: making `path` would create the link's target, a place the
    user did not name (fileio.dangling_link)."""
    problem = dangling_link_problem(key, path)
    if problem:
        raise UserError(problem)


def _check_no_links(run_dir: Path, key: str) -> None:
    """dsrecipes never makes a symbolic link in a run directory; one found there (a log or a ledger pointing
    elsewhere) would make this run write through it, so the run is refused, the link named."""
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            path = Path(root) / name
            if path.is_symlink():
                raise UserError(f"{key}: {path} is a symbolic link (to {os.readlink(path)}); dsrecipes makes none "
                                "in a run directory and writes through none. Remove it, or choose another directory; "
                                "nothing was changed")


def check_writable(path: Path, key: str) -> None:
    probe = path / f".dsrecipes-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{key}: {path} is not writable ({exc.strerror or exc})") from None


def read_marker(run_dir: Path, key: str = "run directory") -> Dict[str, Any]:
    path = Path(run_dir) / MARKER_FILE
    try:
        marker = read_json_file(path, "JSON nested too deeply")  # a FIFO there: refused, never waited on
        if not isinstance(marker, dict) or marker.get("dsrecipes_run") != 1:
            raise ValueError("not a dsrecipes run marker")
        return marker
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}: {path} is unreadable ({exc}); this directory cannot be trusted as a dsrecipes run") \
            from None


def claim_sweep_dir(sweep_dir: Path, key: str = "hydra.sweep.dir") -> Path:
    """Make `sweep_dir` a dsrecipes sweep directory before Hydra writes anything into it (claim_marked_dir). Its
    jobs' directories are `<sweep_dir>/<job number>` (hydra.sweep.subdir is closed to overrides: config/safety.py),
    so nothing of a foreign directory is written."""
    claim_marked_dir(Path(sweep_dir), key, SWEEP_MARKER, "a dsrecipes sweep directory")
    return Path(sweep_dir)


def claim_marked_dir(path: Path, key: str, marker: str, what: str,
                     refused: Optional[Dict[str, str]] = None) -> List[Path]:
    """A directory made ours before anything is written into it: created (or taken empty) and marked with `marker`
    (JSON `{<marker's stem>: 1}`), or one that holds our `marker` already. A file, an unreadable directory, a
    forged marker, a non-empty directory without the marker, or one holding a name of `refused` (name -> why) is a
    UserError naming `key`, nothing changed. Returns what this call created: the marker, then the directories it
    made, deepest first (for taking them back after a failure)."""
    refuse_dangling_link(path, key)
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}: {path} is a file, not a directory; choose a directory for {what}")
    try:
        entries = sorted(os.listdir(path)) if path.is_dir() else []
    except OSError as exc:
        raise UserError(f"{key}: cannot read {path} ({exc.strerror or exc})") from None
    for name in (n for n in entries if n in (refused or {})):
        raise UserError(f"{key}: {path} {refused[name]}; choose another directory; nothing was changed")
    tag = Path(marker).stem
    if marker in entries:
        try:
            ours = read_json_file(path / marker, "JSON nested too deeply").get(tag) == 1  # bounded: anyone's file
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise UserError(f"{key}: {path / marker} is not our marker; choose another directory; nothing was changed")
        check_writable(path, key)
        return []
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UserError(f"{key}: {path} is not empty ({shown}) and is not {what} (no {marker}); dsrecipes writes "
                        "only into a new or empty directory or one of its own. Choose another directory; nothing was "
                        "changed")
    made = missing_dirs(path)
    if made:
        make_dir(path, key)
    else:
        check_writable(path, key)
    return [atomic_write_json(path / marker, {tag: 1, "created": time.strftime("%Y-%m-%d %H:%M:%S")}), *made]


def unique_new_dir(base: Path) -> Path:
    """Create and return `base`, or `base-1`, `base-2`, ... when it exists: a default run directory of its own
    even for runs started in the same second (mkdir is atomic, so two processes never get the same one)."""
    for n in range(10_000):
        path = base if n == 0 else base.with_name(f"{base.name}-{n}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(f"hydra.run.dir: cannot create {path} ({exc.strerror or exc}); run from a writable "
                            "directory or set trainer.output_dir") from None
    raise UserError(f"{base}: no free run directory name")


def rank_lock(run_dir: Path) -> SharedLock:
    """Held by every rank while it runs (see `claim`, which probes it)."""
    try:
        return SharedLock(Path(run_dir) / RANKS_LOCK_FILE).acquire()
    except LockHeld as exc:
        raise UserError(f"{exc.path}: held exclusively by {exc.holder}, so this rank cannot start (a launching "
                        "process holds it for an instant only); stop that process") from None


def launcher_alive(run_dir: Path) -> bool:
    """The launching process still holds the run directory: false once it died (even by SIGKILL), true while the
    lock cannot be probed (shared storage's transient ESTALE or EIO, `locks.probe_held`): a storage hiccup is no
    reason to stop a run's ranks (rank/train.stop_requested, stopping.watch) or for node 1 to give up on node 0."""
    return probe_held(Path(run_dir) / LOCK_FILE) is not False


def holds_run(run_dir: Path) -> Optional[str]:
    """What a run left in `run_dir` that a fresh start would mix with or destroy (None when nothing)."""
    steps = sorted(int(d.name.split("_", 1)[1]) for d in (Path(run_dir) / CHECKPOINTS_DIR).glob("step_*")
                   if d.is_dir() and d.name.split("_", 1)[1].isdigit())
    if steps:
        return f"checkpoints up to step {steps[-1]}"
    logged = [r["step"] for r in read_metrics(run_dir) if "step" in r]
    return f"metrics up to step {max(logged)}" if logged else None


# ---------------------------------------------------------------------------------------------------------------
# Files


def write_config(run_dir: Path, data: Dict[str, Any]) -> Path:
    return atomic_write_text(run_dir / CONFIG_FILE, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def write_ds_config(run_dir: Path, ds_config: Dict[str, Any]) -> Path:
    return atomic_write_json(run_dir / DS_CONFIG_FILE, ds_config)


def read_ds_config(run_dir: Path) -> Dict[str, Any]:
    """The DeepSpeed dict the launching process wrote for the real world size (ranks never rebuild it)."""
    path = Path(run_dir) / DS_CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{path}: missing; start runs with `python -m dsrecipes` (it writes the run directory)")
    try:
        return read_json_file(path, "JSON nested too deeply", limit=MAX_DS_CONFIG_BYTES)
    except ValueError as exc:  # a damaged (or someone else's) run directory: never read whole, nor a RecursionError
        raise UserError(f"{path}: {exc}, not the DeepSpeed config dsrecipes writes (a few KB); start the run "
                        "again with `python -m dsrecipes`") from None


def write_result(run_dir: Path, code: int, error: Optional[str], status: str = "ok", **extra: Any) -> Path:
    """<run>/result.json: status, exit code, error, the headline numbers and peak resident memory (strict JSON).
    `status` is kept for a zero exit code and for "interrupted"; any other non-zero exit is "failed". `extra` keys
    (the interrupted run's checkpoint and resume command, a non-finite step, ...) are added as given."""
    peak_kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    kept = code == 0 or status == "interrupted"
    result: Dict[str, Any] = {"status": status if kept else "failed", "exit_code": code, "error": error}
    try:
        result.update(run_summary(run_dir))
    except UserError as exc:  # a damaged metrics.jsonl: the result still says how the run ended
        result["metrics_error"] = str(exc)
    result.update(peak_mem_mb=round(peak_kb / 1024, 1))
    result.update(extra)
    try:
        return atomic_write_json(run_dir / RESULT_FILE, result)
    except OSError as exc:  # a full disk: the run still ends with its own message and exit code
        print(f"warning: {run_dir / RESULT_FILE} not written: {exc.strerror or exc}", file=sys.stderr, flush=True)
        return run_dir / RESULT_FILE
