"""Checkpoints that survive a kill, exact resume and retention (choosing one to resume from: checkpoint_find.py;
export to Hugging Face: export.py).

Layout of `<run>/checkpoints/`:

    step_<N>/                     DeepSpeed's files (engine.save_checkpoint, save_latest=False) plus ours:
        data_state/rank<R>.json   each rank's data position (loader.state_dict()); DeepSpeed keeps only rank 0's
                                  client_state, so per-rank positions cannot go there
        rng/rank<R>.pt            each rank's python / numpy / torch RNG states (DeepSpeed saves none)
        config.yaml               the settings that wrote it (the resume contract compares against them)
        complete.json             the commit record, written last: step, world size, data fingerprint and the size
                                  and hash of every other file (manifest.py), signed with this user's key (trust.py)
    latest                        the tag of the newest checkpoint (same format as DeepSpeed's own file)

A save writes into `step_<N>.partial/` and rank 0 publishes it as `step_<N>` (core/publish.py) only after every rank
finished and complete.json is written, so a tag is never half written and never half old, half new (re-saving an
existing tag, after an explicit resume from an earlier step, exchanges the whole directories in one step). A resume
checks the checkpoint again in each rank, right before each file is unpickled (boundary/point_of_use.py). A run killed mid-save leaves a
`.partial` directory, which the next save or retention pass removes. LoRA runs leave the frozen base out
(`exclude_frozen_parameters`); it is rebuilt from `model.path` (or the tiny model's seed) on resume and export.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch

import dsrecipes.boundary.safe_load as safe_load
import dsrecipes.core.disk_space as disk_space
import dsrecipes.core.manifest as manifest
from dsrecipes.boundary.point_of_use import ChangedCheckpoint, CheckedCheckpoint
from dsrecipes.boundary.trust import sign, signature_problem
from dsrecipes.core.checkpoint_names import (
    CHECKPOINTS,
    COMPLETE,
    LATEST,
    PARTIAL,
    REPLACED,
    UNIVERSAL,
    commit_order,
    step_of,
    tag_for,
)
from dsrecipes.core.console import kept_in_log
from dsrecipes.core.distributed import all_ranks
from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import atomic_write_json, atomic_write_text, loads_bounded, read_json_file
from dsrecipes.core.locks import lock_holder_pids, unread
from dsrecipes.core.publish import Existing, publish_dir
from dsrecipes.core.rundir import CONFIG_FILE
from dsrecipes.core.runplan import ResumePlan
from dsrecipes.rank.selection import check_state as check_selection


@dataclass
class TrainState:
    """Run progress, global (identical on every rank): saved in DeepSpeed's client_state."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch the data loader is in
    samples_seen: int = 0  # samples (packed rows count their samples) over all ranks
    elapsed: float = 0.0  # training seconds over all attempts
    skipped_steps: int = 0  # steps dropped for a non-finite loss (trainer.nan_policy=skip)
    selection: Dict[str, Any] = field(default_factory=dict)  # best step/value, patience counter (selection.py)

    def __post_init__(self) -> None:  # a trusted foreign checkpoint's train_state is data: ValueError, named by
        for name in ("step", "epoch", "samples_seen", "skipped_steps"):  # load_checkpoint's _as_written
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= 2**53:
                raise ValueError(f"{name} must be a whole number from 0 to 2**53, got {str(value)[:40]}")
        if type(self.elapsed) not in (int, float) or not 0 <= self.elapsed < float("inf"):
            raise ValueError(f"elapsed must be a finite number of seconds, got {str(self.elapsed)[:40]}")
        check_selection(self.selection)


# ---------------------------------------------------------------------------------------------------------------
# Save (every rank)


def save_checkpoint(engine: Any, loader: Any, state: TrainState, run_dir: Path, keep: int, *,
                    frozen_excluded: bool, record: Dict[str, Any], protect: Sequence[str] = ()) -> Path:
    """Collective: every rank writes its shards, data position and RNG into `step_<N>.partial`; rank 0 then
    commits (complete.json, rename, `latest`) and prunes (never the tags in `protect`: the best checkpoint). `record` goes into complete.json (data fingerprint).
    A disk that fills up on any rank: every rank agrees, the partial directory is removed, the checkpoints already
    committed stay as they are, and OutOfSpace (exit 1, result.json failed) names the path and the bytes needed."""
    import torch.distributed as dist

    rank = dist.get_rank()
    root = Path(run_dir) / CHECKPOINTS
    tag = tag_for(state.step)
    staging = root / (tag + PARTIAL)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # left by a save of this step that was killed
    dist.barrier()
    full = disk_space.fits(staging, lambda: _write_rank_files(engine, loader, state, staging, rank, frozen_excluded))
    _stop_if_full(root, staging, full)
    full = None
    if rank == 0:
        record = {**record, "step": state.step, "world_size": dist.get_world_size(), "saved_at": time.time(),
                  "frozen_excluded": frozen_excluded}
        full = disk_space.fits(staging, lambda: commit(run_dir, staging, root / tag, record))
        if full is None:
            prune_checkpoints(root, keep, protect)
    _stop_if_full(root, staging, full)
    return root / tag


def _write_rank_files(engine: Any, loader: Any, state: TrainState, staging: Path, rank: int,
                      frozen_excluded: bool) -> None:
    with _frozen_aliases_left_out(engine.module, frozen_excluded):
        try:
            engine.save_checkpoint(str(staging.parent), tag=staging.name, client_state={"train_state": asdict(state)},
                                   save_latest=False, exclude_frozen_parameters=frozen_excluded)
        except Exception as exc:  # a rank whose disk filled inside DeepSpeed's save never reaches its closing
            if disk_space.out_of_space(exc, staging):  # barrier, where the others wait: it takes its place there
                import torch.distributed as dist  # (else: all_ranks in _stop_if_full against that barrier, a hang)

                dist.barrier()
            raise
    atomic_write_json(staging / "data_state" / f"rank{rank}.json", loader.state_dict())
    (staging / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), staging / "rng" / f"rank{rank}.pt")


@contextmanager
def _frozen_aliases_left_out(module: torch.nn.Module, active: bool) -> Iterator[None]:
    """DeepSpeed's `exclude_frozen_parameters` drops each frozen parameter under its first name only, so a tied
    alias (`lm_head.weight` of tied embeddings: a whole vocabulary matrix) would still be saved. While saving, every
    name of a frozen parameter is left out of the state dict."""
    if not active:
        yield
        return
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def drop_frozen(_module: Any, state_dict: Dict[str, Any], prefix: str, _metadata: Any) -> None:
        for key in [k for k in state_dict if k[len(prefix):] in frozen]:
            del state_dict[key]

    handle = module.register_state_dict_post_hook(drop_frozen)
    try:
        yield
    finally:
        handle.remove()


def commit(run_dir: Path, staging: Path, final: Path, record: Dict[str, Any]) -> None:
    """Rank 0: the config beside the weights, complete.json (every file's size and hash) last, then the rename."""
    shutil.copyfile(Path(run_dir) / CONFIG_FILE, staging / CONFIG_FILE)
    atomic_write_json(staging / COMPLETE, sign({**record, "files": manifest.describe(staging, skip=[COMPLETE])}))
    # Re-saving a tag (a resume from an earlier step) exchanges the whole directories in one step (publish.py):
    # `final` always names a complete checkpoint; the previous one, now at the staging path, is removed after.
    previous = publish_dir(staging, final, Existing.exchange)
    if previous is not None:
        _drop_replaced(previous, final)
    atomic_write_text(final.parent / LATEST, final.name)


def _drop_replaced(previous: Path, final: Path) -> None:
    """The version of `final` that a re-save replaced (now at `previous`): removed under the exclusive lock on its
    complete.json, as retention removes a checkpoint (`prune_checkpoints`). While a reader holds it (a `dsrecipes
    export` beside the run: point_of_use.reading) it is not waited for: it is renamed `step_<N>.replaced`, which a
    later save's retention removes once it is free, and one line says so."""
    with unread(previous / COMPLETE) as free:
        if free:
            shutil.rmtree(previous, ignore_errors=True)
            return
        pids = lock_holder_pids(previous / COMPLETE)
    aside, n = final.with_name(final.name + REPLACED), 0
    while aside.exists():  # an earlier replaced version still being read
        n += 1
        aside = final.with_name(f"{final.name}.{n}{REPLACED}")
    os.rename(previous, aside)
    holder = f"process(es) {', '.join(map(str, pids))}" if pids else "another process"
    print(f"dsrecipes: {final}: the version this save replaced is being read by {holder} (an export or a resume "
          f"of it); kept as {aside.name} until that reader is done, then removed by a later save's retention "
          f"(trainer.keep_checkpoints)", file=sys.stderr, flush=True)  # fmt: skip


def _stop_if_full(root: Path, staging: Path, full: Optional[str]) -> None:
    """Collective: when any rank ran out of space, remove the partial checkpoint and raise OutOfSpace everywhere."""

    if all_ranks(full is None):
        import torch.distributed as dist

        dist.barrier()
        return
    newest = sorted((d for d in root.glob("step_*") if (d / COMPLETE).is_file()), key=commit_order)
    disk_space.abandon_checkpoint(root / staging.name[: -len(PARTIAL)], staging, newest[-1] if newest else None)


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Dict[str, Any]) -> None:
    """ValueError for states of another shape than rng_state writes, checked before any is set."""
    mine = rng_state()
    for name in ("torch", *(["cuda"] if "cuda" in state and "cuda" in mine else [])):
        given = state[name] if name == "torch" else list(state[name])
        want = mine[name] if name == "torch" else list(mine[name])
        if name == "cuda" and len(given) != len(want):
            raise ValueError(f"{name}: {len(given)} device states, {len(want)} devices here")
        for g, w in zip(*(([given], [want]) if name == "torch" else (given, want))):
            if not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.shape != w.shape:
                raise ValueError(f"{name}: not a generator state of this torch ({w.dtype} {tuple(w.shape)})")
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def prune_checkpoints(root: Path, keep: int, protect: Sequence[str] = ()) -> List[Path]:
    """Delete all but the `keep` most recently committed checkpoints (and the tags in `protect`), plus what killed
    saves left behind.

    Commit order, not step order: after a resume from an earlier step, the checkpoints just written are the ones
    to keep. Only our own names are touched (`step_<N>`, `step_<N>.partial`, `step_<N>.replaced`). A checkpoint
    someone is reading (point_of_use.CheckedCheckpoint holds a shared lock on its complete.json: an export, a
    resume from this run) stays until a later pass."""
    tags = [d for d in root.glob("step_*") if d.is_dir() and d.name.split("_", 1)[1].isdigit()]
    committed = sorted((d for d in tags if (d / COMPLETE).is_file()), key=commit_order)
    kept = set(committed[-keep:]) | {d for d in committed if d.name in protect}
    newest = step_of(committed[-1]) if committed else -1
    removed = [d for d in tags if d not in kept and ((d / COMPLETE).is_file() or step_of(d) <= newest)]
    removed += [d for d in root.glob("step_*") if d.is_dir() and d.name.endswith((PARTIAL, REPLACED))]
    for d in removed:
        with unread(d / COMPLETE) as free:  # a `dsrecipes export` of it beside the run: the next pass removes it
            if free:
                shutil.rmtree(d, ignore_errors=True)
    return [d for d in removed if not d.exists()]


@dataclass
class ResumePoint:
    tag_dir: Path  # the checkpoint (our per-rank files, complete.json)
    load_dir: Path  # engine.load_checkpoint(load_dir, tag)
    tag: str
    saved_world_size: int
    universal: bool = False  # needs `"checkpoint": {"load_universal": true}` in the DeepSpeed config
    frozen_excluded: bool = False  # LoRA: the frozen base is not in it (the model built from model.path has it)
    checked: Optional[CheckedCheckpoint] = None  # its files as its signed records list them, checked on each load


def open_resume(plan: Optional[ResumePlan], run_dir: Optional[Path] = None) -> Optional[ResumePoint]:
    """Collective. The planned checkpoint, ready for the engine: an elastic resume of ZeRO-1/2/3 shards is
    converted once by rank 0 into a universal checkpoint (ds_to_universal --inject_missing_state) that any world size
    can load: `<tag>/universal` in a checkpoint this user's runs wrote; for one trusted on the command line (someone
    else's directory, never written into) `<run_dir>/universal/<tag>`."""
    import torch.distributed as dist

    if plan is None:
        return None
    tag_dir = Path(plan.checkpoint)
    checked = CheckedCheckpoint.open(tag_dir, plan.record_sha256)  # this process checks again (point_of_use.py)
    if checked.record.get("step") != plan.step:
        raise ChangedCheckpoint(f"{tag_dir / COMPLETE}: records step {checked.record.get('step')!r}, the run was "
                                f"planned to resume from step {plan.step}; nothing was loaded")
    frozen_excluded = bool(checked.record.get("frozen_excluded"))
    if not plan.elastic:
        return ResumePoint(tag_dir, tag_dir.parent, tag_dir.name, plan.saved_world_size,
                           frozen_excluded=frozen_excluded, checked=checked)
    foreign = checked.listings[0].screened and run_dir is not None
    out = Path(run_dir) / UNIVERSAL / tag_dir.name if foreign else tag_dir / UNIVERSAL
    if dist.get_rank() == 0 and not universal_verifies(out):
        convert_to_universal(tag_dir, checked, out)
    dist.barrier()
    checked.add(out)  # signed by the conversion (this user's key)
    return ResumePoint(tag_dir, out.parent, out.name, plan.saved_world_size, universal=True,
                       frozen_excluded=frozen_excluded, checked=checked)


def convert_to_universal(tag_dir: Path, checked: Optional[CheckedCheckpoint] = None,
                         out: Optional[Path] = None) -> Path:
    """Into `out` (default `<tag>/universal`). `checked`: every file of the checkpoint the conversion unpickles is
    checked right before (its own temporary slices, written and read back below `out`, pass)."""
    out = tag_dir / UNIVERSAL if out is None else Path(out)
    checked = checked or CheckedCheckpoint.open(tag_dir)
    _clear_universal(out, ours=not checked.listings[0].screened or not out.is_relative_to(tag_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    checked.allow_written(out)
    with checked.guard(), kept_in_log():  # DeepSpeed narrates the conversion and draws bars: the rank's log keeps them
        ds_to_universal(SimpleNamespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                                        num_merge_workers=1, keep_temp_folder=False, strict=True,
                                        inject_missing_state=True))
    # The engine still reads the module/scheduler/client state file from the universal tag (copied as checked).
    for states in sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
        (out / states.name).write_bytes(checked.read_bytes(states))
    atomic_write_json(out / COMPLETE, sign({"source": tag_dir.name, "files": manifest.describe(out, skip=[COMPLETE])}))
    return out


def _clear_universal(out: Path, ours: bool) -> None:
    """Make room for the conversion at `out`: an earlier one that did not verify is removed only from a checkpoint
    this user's runs wrote (`ours`: signed with this user's key); a link there (the conversion would be written
    wherever it leads) or a directory in someone else's checkpoint is refused, left as it is."""
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir() or not ours:
        what = "a link" if out.is_symlink() else "not a directory" if not out.is_dir() else \
            "a directory in a checkpoint this user's runs did not write"
        raise UserError(f"{out}: {what}; an elastic resume writes its universal conversion there and removes only "
                        "a conversion of its own. Nothing was changed: resume from a copy of the checkpoint without "
                        f"{UNIVERSAL}/, or at its saved world size")
    shutil.rmtree(out, ignore_errors=True)


def universal_verifies(out: Path) -> bool:
    """A universal conversion made earlier (at `out`) is reused only when this user signed it and its files are as
    written (complete.json of the checkpoint does not cover it: it is made after the commit)."""

    try:  # bounded: a trusted foreign checkpoint's universal/ is anyone's (100000 '[' was a RecursionError)
        record = read_json_file(out / COMPLETE, "JSON nested too deeply")
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and isinstance(record.get("files"), dict) and signature_problem(record) is None
            and manifest.verify(out, record["files"]) is None)


def load_checkpoint(engine: Any, loader: Any, point: ResumePoint) -> TrainState:
    """Collective: model/optimizer/scheduler via DeepSpeed, then this rank's data position and RNG (restored last,
    so nothing between here and the first step draws from it).

    At another world size every rank's saved position is the same global position (equal step counts), which the
    data loader maps onto the new layout; RNG states are then left seeded, so such a resume is not step-exact.
    """
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    checked = point.checked or CheckedCheckpoint.open(point.tag_dir)
    with checked.guard():  # every file DeepSpeed unpickles is checked right before (point_of_use.py)
        load_path, client_state = engine.load_checkpoint(str(point.load_dir), tag=point.tag,
                                                         load_module_strict=not point.frozen_excluded)
    if load_path is None:
        raise UserError(f"trainer.resume: DeepSpeed could not load {point.tag_dir}")
    source_rank = min(rank, point.saved_world_size - 1)
    state_file = point.tag_dir / "data_state" / f"rank{source_rank}.json"
    position = data_position(checked.read_bytes(state_file), state_file)
    with _as_written(state_file):  # a trusted foreign checkpoint's position is data of any shape
        loader.load_state_dict(position)
    if point.saved_world_size == world_size:
        rng_file = point.tag_dir / "rng" / f"rank{rank}.pt"
        rng = safe_load.load(rng_file, checked)
        with _as_written(rng_file):  # states of another size: torch's RuntimeError, numpy's ValueError
            restore_rng(rng)
    checked.close()
    with _as_written(point.tag_dir, "its train_state (DeepSpeed's client_state)"):
        state = TrainState(**client_state["train_state"])
        if state.step != checked.record.get("step"):
            raise ValueError(f"step {state.step}, but its {COMPLETE} records step {checked.record.get('step')}")
        return state


def data_position(raw: bytes, state_file: Path) -> Any:
    """A rank's saved data position (`data_state/rank<R>.json`): a trusted foreign checkpoint's is data of any shape,
    nested too deeply (json's RecursionError in every rank) included: one message naming it."""
    with _as_written(state_file):
        return loads_bounded(raw, "JSON nested too deeply to be a data position")


@contextmanager
def _as_written(path: Path, what: str = "") -> Iterator[None]:
    """Reading what a checkpoint holds: a file of another shape than dsrecipes writes (a colleague's checkpoint,
    loaded with --trust-checkpoint, whose hashes and signature prove nothing about its contents) is one message
    naming it, not a KeyError traceback from the rank. The loaders' own refusals (DataError: another data setup)
    pass as they are."""
    try:
        yield
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ChangedCheckpoint(f"{path}{': ' + what if what else ''}: not as dsrecipes writes it "
                                f"({type(exc).__name__}: {str(exc)[:200]}); resume from another checkpoint "
                                "(trainer.resume_from) or start a fresh run (trainer.resume=never)") from None
