"""The run plan: every decision the launching process makes for the ranks, written once as `<run>/plan.json`.

The launching process composes, prepares the data, counts what the ranks will read, decides the resume point and
writes this plan (plus `config.yaml` and `ds_config.json`, which is built from it). Ranks read it and check that
what they see agrees (their world size, their loader's steps per epoch); none of them recomputes a step count or a
resume decision. The plan is plain data, so it also documents a run after the fact.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import atomic_write_json
from dsrecipes.core.rundir import launcher_alive

PLAN_FILE = "plan.json"
PLAN_VERSION = 1
NODE_LOCK = ".dsrecipes.node{}.lock"  # held by node N's `dsrecipes node` (run/join.py) while its ranks run
NODE_LOCK_ENV = "DSRECIPES_NODE_LOCK"  # that file, named by `dsrecipes node` to the ranks it starts
_NODE_LOCK_NAME = re.compile(r"\.dsrecipes\.node[1-9][0-9]{0,5}\.lock")


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a run continues from."""

    checkpoint: str  # the tag directory (checkpoints/step_<N>) holding complete.json
    step: int  # optimizer steps it had done
    saved_world_size: int  # ranks that wrote it
    elastic: bool  # ZeRO-1/2/3 states saved at another world size: loaded through a universal checkpoint
    record_sha256: Optional[str] = None  # complete.json as the launching process checked it (ranks check it again)


@dataclass(frozen=True)
class RunPlan:
    world_size: int  # data-parallel ranks the launcher starts
    num_nodes: int
    data_kind: str  # data.kind
    rows: Optional[int]  # training rows of one epoch (None: a stream of unknown length)
    steps_per_epoch: Optional[int]  # optimizer steps per epoch, equal on every rank (None: endless stream)
    total_steps: int  # optimizer steps of the whole run
    data_fingerprint: str  # content key of the training data (files, preparation), for resume checks
    resume: Optional[ResumePlan] = None
    data_files: Dict[str, str] = field(default_factory=dict)  # content hash of each training file (resume checks)
    data_prepared: Dict[str, Any] = field(default_factory=dict)  # what else made the fingerprint: preparation
    # version, dsrecipes release, tokenizer (data/prepare/cache.preparation_record; resume messages)
    newest_checkpoint: Optional[str] = None  # the run dir's newest committed checkpoint when planned (ranks check)
    supervised: bool = False  # a launching process holds the run directory's lock while the ranks run
    past_stop: bool = False  # the resumed checkpoint stopped early and this run trains on (resume_contract)
    exports: Dict[str, str] = field(default_factory=dict)  # export dir -> its record as accepted (trust.record_pin):
    # a reward model a rank loads only as its launching process checked it (signed, or trusted on its command line)
    version: int = PLAN_VERSION

    @property
    def elastic(self) -> bool:
        return self.resume is not None and self.resume.elastic

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "RunPlan":
        resume = data.get("resume")
        return cls(**{**data, "resume": None if resume is None else ResumePlan(**resume)})


def write_plan(run_dir: str | Path, plan: RunPlan) -> Path:
    return atomic_write_json(Path(run_dir) / PLAN_FILE, plan.to_dict())


def read_plan(run_dir: str | Path) -> RunPlan:
    path = Path(run_dir) / PLAN_FILE
    if not path.is_file():
        raise UserError(f"{path}: missing; start runs with `python -m dsrecipes` (it writes the run directory)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')!r}, expected {PLAN_VERSION}")
        return RunPlan.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise UserError(f"{path}: unreadable run plan ({exc}); start the run again with `python -m dsrecipes`") from None


def reported_by_launcher(run_dir: Path) -> bool:
    """A launching process supervises the ranks and prints the first failure itself (RunPlan.supervised) - when it
    is still there: a rank started by a batch job from a plan a supervised launch wrote says it itself."""
    try:
        return bool(read_plan(run_dir).supervised) and launcher_alive(run_dir)
    except Exception:  # noqa: BLE001 - an unreadable plan: say it here rather than nowhere
        return False


def node_lock(run_dir: Path) -> Optional[Path]:
    """The lock of the `dsrecipes node` that started this rank (a node > 0 of a no-ssh multi-node run), from
    NODE_LOCK_ENV: only a `.dsrecipes.nodeN.lock` directly in `run_dir` (launcher.env cannot set the name: it is
    not on its positive list); None anywhere else."""
    named = os.environ.get(NODE_LOCK_ENV)
    if not named:
        return None
    path = Path(named)
    return path if path.parent == Path(run_dir).resolve() and _NODE_LOCK_NAME.fullmatch(path.name) else None
