"""Which checkpoint a run continues from, decided once by the launching process (ranks follow plan.json, which
pins the record checked here; each rank checks again where it loads: point_of_use.py).

A checkpoint is used only when its commit record (complete.json) reads, carries this user's signature (trust.py:
else the run is refused, exit 2, naming `dsrecipes train ... --trust-checkpoint PATH`), every file it lists has its
size and hash (manifest.py); one trusted on the command line instead must also hold no pickle that imports beyond
an allow-list (safe_load.screen). `verified` is
that one check; export, prompt-eval and chat use it too. `trainer.resume=auto` takes the most recently committed checkpoint that verifies, naming
each damaged one it passes over; when checkpoints exist but none verifies, it stops (starting over would bury
them). An explicit `trainer.resume_from` naming one checkpoint must verify, or the run stops (exit 2) naming the
damaged file. Records of older dsrecipes versions are unsigned: they load only with --trust-checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, List, Optional

import dsrecipes.boundary.safe_load as safe_load
import dsrecipes.boundary.trust as trust
import dsrecipes.core.manifest as manifest
from dsrecipes.boundary.point_of_use import record_digest
from dsrecipes.core.checkpoint_names import CHECKPOINTS, COMPLETE, UNIVERSAL, commit_order, read_record, step_of
from dsrecipes.core.errors import Refused, UserError
from dsrecipes.core.fileio import MAX_JSON_BYTES, loads_bounded, read_regular_bytes
from dsrecipes.core.runplan import ResumePlan
from dsrecipes.core.schema import ResumeMode, TrainerConfig

Report = Callable[[str], None]
TRAIN_RETRY = "dsrecipes train ..."


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def damage(tag_dir: Path, retry: str = TRAIN_RETRY) -> Optional[str]:
    """None when the checkpoint verifies, else what is wrong with it (naming the file). A readable record that
    is not signed by this user raises trust.Untrusted (`retry`: the command the message tells to repeat); a pickle
    that would import more than data raises UserError."""
    try:
        record = read_record(tag_dir)
    except OSError:
        return f"{COMPLETE}: missing (the save did not finish)"
    except ValueError as exc:
        return f"{COMPLETE}: unreadable ({exc})"
    ours = trust.check(record, Path(tag_dir), "checkpoint", retry)
    named = Path(tag_dir).name.split("_", 1)
    if named[0] == "step" and named[-1].isdigit() and record["step"] != step_of(tag_dir):
        return (f"{COMPLETE}: records step {record['step']}, but the directory is named {Path(tag_dir).name} (a "
                "renamed checkpoint would resume from another step than it says)")
    files = record.get("files")
    problem = None if files is None else (manifest.verify(tag_dir, files)
                                          or manifest.unlisted(tag_dir, files, ignore=[COMPLETE, UNIVERSAL]))
    if problem is None and not ours:  # trusted on the command line: still no pickle that imports code
        safe_load.screen(tag_dir)
    return problem


def verified(tag_dir: Path, retry: str) -> Path:
    """The one check before anything loads a checkpoint outside training (export): signed (or trusted on the
    command line), every file as written, no pickle that imports code. UserError otherwise."""
    problem = damage(tag_dir, retry)
    if problem is not None:
        raise UserError(f"{tag_dir}: damaged checkpoint ({problem}); nothing was loaded")
    return Path(tag_dir)


def committed(root: Path) -> List[Path]:
    """Tag directories holding a commit record (readable or not), newest commit first."""
    tags = [d for d in Path(root).glob("step_*") if d.is_dir() and d.name.split("_", 1)[1].isdigit()]
    return sorted((d for d in tags if (d / COMPLETE).exists()), key=commit_order, reverse=True)


def newest_verified(root: Path, report: Report = _stderr, retry: str = TRAIN_RETRY) -> Optional[Path]:
    """The most recently committed checkpoint under `root` that verifies (None when there is none at all)."""
    tags = committed(root)
    damaged = []
    for tag_dir in tags:
        problem = damage(tag_dir, retry)
        if problem is None:
            return tag_dir
        damaged.append(f"{tag_dir.name}: {problem}")
        report(f"warning: checkpoint {tag_dir} is damaged ({problem}); falling back to an older one")
    if damaged:
        raise Refused(f"{root}: no checkpoint verifies ({'; '.join(damaged)}). Nothing was changed; resume from "
                        "a copy you trust with trainer.resume_from=PATH, or start a new run in another "
                        "trainer.output_dir")
    return None


def find_resume_checkpoint(trainer: TrainerConfig, run_dir: Path, report: Report = _stderr) -> Optional[Path]:
    """The tag dir a run continues from, or None: `trainer.resume_from` when set, else with `trainer.resume=auto`
    the newest verified checkpoint of this run directory."""
    if trainer.resume is ResumeMode.never:
        return None
    if trainer.resume_from is None:
        return newest_verified(Path(run_dir) / CHECKPOINTS, report)
    path = Path(trainer.resume_from).expanduser()
    if (path / COMPLETE).exists() or (path.name.startswith("step_") and path.is_dir()):
        problem = damage(path)
        if problem is not None:
            raise Refused(f"trainer.resume_from: {path} is not a complete checkpoint that verifies: {problem}. "
                            "Nothing was changed; name an earlier checkpoint or the run directory (which falls "
                            "back to its newest good checkpoint)")
        return path
    for candidate in (path / CHECKPOINTS, path):
        if candidate.is_dir():
            found = newest_verified(candidate, report)
            if found is not None:
                return found
    raise UserError(
        f"trainer.resume_from: {trainer.resume_from!r} is not a complete checkpoint (a checkpoints/step_<N> dir with "
        f"{COMPLETE}), nor a run or checkpoints directory holding one"
    )


def latest_complete(root: Path, report: Report = _stderr, retry: str = TRAIN_RETRY) -> Optional[Path]:
    """The newest verified checkpoint under a checkpoints directory (what `dsrecipes export` takes by default)."""
    return newest_verified(root, report, retry)


def trust_to_repeat(run_dir: Path, keeps_resume_from: bool) -> List[str]:
    """The `--trust-checkpoint PATH` arguments a printed command that continues this training run in `run_dir`
    needs (trust.repeat_flags): the paths trusted on this command line that accepted an export (a reward model,
    checked again at every launch), or the checkpoint it continues from: `keeps_resume_from`, the kept
    trainer.resume_from's; else the run directory's newest committed one (a checkpoint this run wrote is signed by
    this user and needs none)."""
    newest = committed(Path(run_dir) / CHECKPOINTS)
    resumes = None if keeps_resume_from or not newest else newest[0].resolve()
    return trust.repeat_flags(lambda what, where: what != "checkpoint" or resumes is None or where == resumes)


def plan_resume(trainer: TrainerConfig, run_dir: Path, world_size: int, zero_stage: int,
                report: Report = _stderr) -> Optional[ResumePlan]:
    """What the run continues from (reads files only: the launching process calls this once, before any rank).

    Another world size (elastic resume): ZeRO-0 states are whole and load as saved; ZeRO-1/2/3 shards go through a
    DeepSpeed universal checkpoint (`"checkpoint": {"load_universal": true}` in ds_config.json). The user's
    checkpoint signing key is made here if need be (trust.py; outside the run directory)."""
    trust.ensure_key()
    tag_dir = find_resume_checkpoint(trainer, run_dir, report)
    if tag_dir is None:
        return None
    try:  # pinned: each rank loads only against this very record
        data = read_regular_bytes(tag_dir / COMPLETE, MAX_JSON_BYTES)  # a FIFO swapped in: refused, never waited on
        record = loads_bounded(data, "JSON nested too deeply")
        saved, step = int(record["world_size"]), int(record["step"])
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise Refused(f"{tag_dir / COMPLETE}: changed while the run was planned ({exc}); nothing was loaded")
    trust.check(record, tag_dir, "checkpoint", TRAIN_RETRY)  # the bytes pinned are a record accepted above
    elastic = saved != world_size and zero_stage > 0
    return ResumePlan(str(tag_dir.resolve()), step, saved, elastic, record_digest(data))
