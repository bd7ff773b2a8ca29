"""Checkpoints that survive a kill, exact resume and retention (export to Hugging Face: export.py).

Layout of `<run>/checkpoints/`:

    step_<N>/                     DeepSpeed's files (engine.save_checkpoint, save_latest=False) plus ours:
        data_state/rank<R>.json   each rank's data position (loader.state_dict()); DeepSpeed keeps only rank 0's
                                  client_state, so per-rank positions cannot go there
        rng/rank<R>.pt            each rank's python / numpy / torch RNG states (DeepSpeed saves none)
        complete.json             written by rank 0 after every rank finished writing (barrier)
    latest                        the tag of the newest complete checkpoint (same format as DeepSpeed's own file),
                                  replaced atomically (tmp + os.replace) only after complete.json exists

A run killed mid-save leaves a step dir without complete.json and `latest` still naming the previous checkpoint,
so `trainer.resume=auto` restarts from the last good one. The partial dir is removed by the next retention pass.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from dsrecipes.config.schema import ResumeMode, TrainerConfig
from dsrecipes.errors import UserError
from dsrecipes.fileio import atomic_write_json, atomic_write_text
from dsrecipes.runplan import ResumePlan

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "complete.json"
UNIVERSAL = "universal"
# Fault injection for tests: kill every rank after the engine checkpoint of this step is written, before `latest`.
KILL_BEFORE_LATEST_ENV = "DSRECIPES_KILL_BEFORE_LATEST"


@dataclass
class TrainState:
    """Run progress, global (identical on every rank): saved in DeepSpeed's client_state."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch the data loader is in
    samples_seen: int = 0  # samples (packed rows count their samples) over all ranks
    elapsed: float = 0.0  # training seconds over all attempts


def tag_for(step: int) -> str:
    return f"step_{step}"


def step_of(tag_dir: Path) -> int:
    return int(tag_dir.name.split("_", 1)[1])


# ---------------------------------------------------------------------------------------------------------------
# Save (every rank)


def save_checkpoint(engine: Any, loader: Any, state: TrainState, run_dir: Path, keep: int) -> Path:
    """Collective: every rank writes its shards, data position and RNG; rank 0 then commits `latest` and prunes."""
    import torch.distributed as dist

    rank = dist.get_rank()
    root = Path(run_dir) / CHECKPOINTS
    tag = tag_for(state.step)
    engine.save_checkpoint(str(root), tag=tag, client_state={"train_state": asdict(state)}, save_latest=False)
    tag_dir = root / tag
    atomic_write_json(tag_dir / "data_state" / f"rank{rank}.json", loader.state_dict())
    (tag_dir / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tag_dir / "rng" / f"rank{rank}.pt")
    dist.barrier()
    if os.environ.get(KILL_BEFORE_LATEST_ENV) == str(state.step):
        os._exit(17)  # simulate a crash between the shard writes and the commit
    if rank == 0:
        atomic_write_json(tag_dir / COMPLETE, {"step": state.step, "world_size": dist.get_world_size()})
        atomic_write_text(root / LATEST, tag)
        prune_checkpoints(root, keep)
    dist.barrier()
    return tag_dir


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def prune_checkpoints(root: Path, keep: int) -> List[Path]:
    """Delete all but the newest `keep` complete checkpoints, and partial ones older than the newest complete one."""
    dirs = sorted((d for d in root.glob("step_*") if d.is_dir()), key=step_of)
    complete = [d for d in dirs if (d / COMPLETE).is_file()]
    kept = set(complete[-keep:])
    newest = step_of(complete[-1]) if complete else -1
    removed = [d for d in dirs if d not in kept and step_of(d) <= newest]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


# ---------------------------------------------------------------------------------------------------------------
# Find (the launching process decides; ranks follow the plan)


def find_resume_checkpoint(trainer: TrainerConfig, run_dir: Path) -> Optional[Path]:
    """The tag dir a run continues from, or None: `trainer.resume_from` when set, else with `trainer.resume=auto`
    the newest complete checkpoint of this run directory."""
    if trainer.resume is ResumeMode.never:
        return None
    if trainer.resume_from is None:
        return latest_complete(Path(run_dir) / CHECKPOINTS)
    path = Path(trainer.resume_from).expanduser()
    for candidate in (path, path / CHECKPOINTS):
        if (candidate / COMPLETE).is_file():
            return candidate
        found = latest_complete(candidate)
        if found is not None:
            return found
    raise UserError(
        f"trainer.resume_from: {trainer.resume_from!r} is not a complete checkpoint (a checkpoints/step_<N> dir with "
        f"{COMPLETE}), nor a run or checkpoints directory holding one"
    )


def latest_complete(root: Path) -> Optional[Path]:
    """The tag named by `latest` when it is complete, else the newest complete step dir (None when there is none)."""
    pointer = root / LATEST
    if pointer.is_file():
        tag_dir = root / pointer.read_text(encoding="utf-8").strip()
        if (tag_dir / COMPLETE).is_file():
            return tag_dir
    complete = sorted((d for d in root.glob("step_*") if (d / COMPLETE).is_file()), key=step_of)
    return complete[-1] if complete else None


def plan_resume(trainer: TrainerConfig, run_dir: Path, world_size: int, zero_stage: int) -> Optional[ResumePlan]:
    """What the run continues from (reads files only: the launching process calls this once, before any rank).

    Another world size (elastic resume): ZeRO-0 states are whole and load as saved; ZeRO-1/2/3 shards go through a
    DeepSpeed universal checkpoint (`"checkpoint": {"load_universal": true}` in ds_config.json)."""
    tag_dir = find_resume_checkpoint(trainer, run_dir)
    if tag_dir is None:
        return None
    saved = json.loads((tag_dir / COMPLETE).read_text(encoding="utf-8"))["world_size"]
    elastic = saved != world_size and zero_stage > 0
    return ResumePlan(str(tag_dir.resolve()), step_of(tag_dir), saved, elastic)


@dataclass
class ResumePoint:
    tag_dir: Path  # the checkpoint (our per-rank files, complete.json)
    load_dir: Path  # engine.load_checkpoint(load_dir, tag)
    tag: str
    saved_world_size: int
    universal: bool = False  # needs `"checkpoint": {"load_universal": true}` in the DeepSpeed config


def open_resume(plan: Optional[ResumePlan]) -> Optional[ResumePoint]:
    """Collective. The planned checkpoint, ready for the engine: an elastic resume of ZeRO-1/2/3 shards is
    converted once by rank 0 into a universal checkpoint (`<tag>/universal`, ds_to_universal
    --inject_missing_state) that any world size can load."""
    import torch.distributed as dist

    if plan is None:
        return None
    tag_dir = Path(plan.checkpoint)
    if not plan.elastic:
        return ResumePoint(tag_dir, tag_dir.parent, tag_dir.name, plan.saved_world_size)
    if dist.get_rank() == 0 and not (tag_dir / UNIVERSAL / COMPLETE).is_file():
        convert_to_universal(tag_dir)
    dist.barrier()
    return ResumePoint(tag_dir, tag_dir, UNIVERSAL, plan.saved_world_size, universal=True)


def convert_to_universal(tag_dir: Path) -> Path:
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    out = tag_dir / UNIVERSAL
    shutil.rmtree(out, ignore_errors=True)
    ds_to_universal(SimpleNamespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                                    num_merge_workers=1, keep_temp_folder=False, strict=True,
                                    inject_missing_state=True))
    # The engine still reads the module/scheduler/client state file from the universal tag.
    for states in tag_dir.glob("mp_rank_*_model_states.pt"):
        shutil.copy2(states, out / states.name)
    atomic_write_json(out / COMPLETE, {"source": tag_dir.name})
    return out


def load_checkpoint(engine: Any, loader: Any, point: ResumePoint) -> TrainState:
    """Collective: model/optimizer/scheduler via DeepSpeed, then this rank's data position and RNG (restored last,
    so nothing between here and the first step draws from it).

    At another world size every rank's saved position is the same global position (equal step counts), which the
    data loader maps onto the new layout; RNG states are then left seeded, so such a resume is not step-exact.
    """
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    load_path, client_state = engine.load_checkpoint(str(point.load_dir), tag=point.tag)
    if load_path is None:
        raise UserError(f"trainer.resume: DeepSpeed could not load {point.tag_dir}")
    source_rank = min(rank, point.saved_world_size - 1)
    data_state = point.tag_dir / "data_state" / f"rank{source_rank}.json"
    loader.load_state_dict(json.loads(data_state.read_text(encoding="utf-8")))
    if point.saved_world_size == world_size:
        restore_rng(torch.load(point.tag_dir / "rng" / f"rank{rank}.pt", weights_only=False))
    return TrainState(**client_state["train_state"])
