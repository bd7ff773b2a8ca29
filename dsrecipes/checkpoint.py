"""Checkpoints that survive a kill, exact resume, retention, and export to a Hugging Face model directory.

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

import argparse
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from dsrecipes.config.schema import TrainConfig
from dsrecipes.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
COMPLETE = "complete.json"
UNIVERSAL = "universal"
EXPORT_DIR = "export"
EXPORT_INIT_DIR = "export_init"
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
    _write_json(tag_dir / "data_state" / f"rank{rank}.json", loader.state_dict())
    (tag_dir / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tag_dir / "rng" / f"rank{rank}.pt")
    dist.barrier()
    if os.environ.get(KILL_BEFORE_LATEST_ENV) == str(state.step):
        os._exit(17)  # simulate a crash between the shard writes and the commit
    if rank == 0:
        _write_json(tag_dir / COMPLETE, {"step": state.step, "world_size": dist.get_world_size()})
        _atomic_write_text(root / LATEST, tag)
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
# Find and load


def find_resume_checkpoint(resume: str, run_dir: Path) -> Optional[Path]:
    """`trainer.resume` -> the tag dir to load, or None. auto: newest complete checkpoint of this run, if any."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_complete(Path(run_dir) / CHECKPOINTS)
    path = Path(resume).expanduser()
    for candidate in (path, path / CHECKPOINTS):
        if (candidate / COMPLETE).is_file():
            return candidate
        found = latest_complete(candidate)
        if found is not None:
            return found
    raise UserError(
        f"trainer.resume: {resume!r} is not a complete checkpoint (a checkpoints/step_<N> dir with {COMPLETE}), "
        "nor a run or checkpoints directory holding one"
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


@dataclass
class ResumePoint:
    tag_dir: Path  # the checkpoint (our per-rank files, complete.json)
    load_dir: Path  # engine.load_checkpoint(load_dir, tag)
    tag: str
    saved_world_size: int
    universal: bool = False  # needs `"checkpoint": {"load_universal": true}` in the DeepSpeed config


def resume_is_elastic(resume: str, run_dir: Path, world_size: int, zero_stage: int) -> bool:
    """Whether resuming needs a universal checkpoint (ZeRO-1/2/3 saved at another world size). Reads files only,
    so the launching process can put `"checkpoint": {"load_universal": true}` into ds_config.json up front."""
    tag_dir = find_resume_checkpoint(resume, run_dir)
    if tag_dir is None or zero_stage == 0:
        return False
    return json.loads((tag_dir / COMPLETE).read_text(encoding="utf-8"))["world_size"] != world_size


def plan_resume(resume: str, run_dir: Path, world_size: int, zero_stage: int) -> Optional[ResumePoint]:
    """Collective. What to load for `trainer.resume`, before the engine exists.

    Same world size: the checkpoint as saved. Another world size (elastic resume): ZeRO-0 states are whole, so they
    load as saved; ZeRO-1/2/3 shards are converted once by rank 0 into a DeepSpeed universal checkpoint
    (`<tag>/universal`, ds_to_universal --inject_missing_state) that any world size can load.
    """
    import torch.distributed as dist

    tag_dir = find_resume_checkpoint(resume, run_dir)
    if tag_dir is None:
        return None
    saved = json.loads((tag_dir / COMPLETE).read_text(encoding="utf-8"))["world_size"]
    if saved == world_size or zero_stage == 0:
        return ResumePoint(tag_dir, tag_dir.parent, tag_dir.name, saved)
    if dist.get_rank() == 0 and not (tag_dir / UNIVERSAL / COMPLETE).is_file():
        convert_to_universal(tag_dir)
    dist.barrier()
    return ResumePoint(tag_dir, tag_dir, UNIVERSAL, saved, universal=True)


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
    _write_json(out / COMPLETE, {"source": tag_dir.name})
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


# ---------------------------------------------------------------------------------------------------------------
# Export (one process; no process group needed)


def export_initial(cfg: TrainConfig, tokenizer: Any, out_dir: Path) -> Path:
    """The embedded tiny model's seeded start, as a HF directory: the baseline for `dsrecipes prompt-eval`."""
    from dsrecipes.model import build_tiny_model

    model = build_tiny_model(cfg, tokenizer)
    return _save_hf(model, tokenizer, out_dir, {"source": "initial weights (model.tiny.seed)", "step": 0})


def export_checkpoint(run_dir: Path, tag_dir: Path, out_dir: Path, cfg: Optional[TrainConfig] = None,
                      merge_lora: Optional[bool] = None) -> Path:
    """Checkpoint -> HF model directory (safetensors + config + tokenizer with its chat template), any ZeRO stage.

    Weights: ZeRO-0/1/2 keep the full module in `mp_rank_00_model_states.pt`; ZeRO-3 shards are consolidated with
    DeepSpeed's zero_to_fp32. LoRA runs write the merged model or the adapter only (`merge_lora`, by default
    `trainer.export_merged_lora`).
    """
    from dsrecipes.config.load import load_run_config
    from dsrecipes.model import TORCH_DTYPES, build_model, load_tokenizer

    cfg = cfg or load_run_config(run_dir)
    tokenizer = load_tokenizer(cfg)
    state_dict = consolidated_state_dict(tag_dir, cfg.zero.stage)
    model = build_model(cfg, tokenizer)  # skeleton on CPU; real models re-read from model.path, then overwritten
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {tag_dir} does not match the model: missing {missing}, unexpected {unexpected}")
    info = {"source": str(tag_dir), "step": step_of(tag_dir)}
    merge_lora = cfg.trainer.export_merged_lora if merge_lora is None else merge_lora
    if cfg.model.lora.enabled and merge_lora:
        model = model.merge_and_unload()
        info["lora"] = "merged"
    elif cfg.model.lora.enabled:
        info["lora"] = "adapter"
    model.to(TORCH_DTYPES[cfg.precision.dtype])
    return _save_hf(model, tokenizer, out_dir, info)


def consolidated_state_dict(tag_dir: Path, zero_stage: int) -> Dict[str, torch.Tensor]:
    if zero_stage == 3:
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return states["module"]


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    # zero_to_fp32 and safetensors-style dicts may drop the second name of a tied (shared) parameter.
    params = dict(model.named_parameters(remove_duplicate=False))
    tensor = params.get(key)
    return tensor is not None and sum(p is tensor for p in params.values()) > 1


def _save_hf(model: Any, tokenizer: Any, out_dir: Path, info: Dict[str, Any]) -> Path:
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    _write_json(tmp / "dsrecipes_export.json", info)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# `dsrecipes export RUN_DIR [--tag T] --out DIR`


def main(argv: List[str]) -> int:
    from dsrecipes.cli import parse

    parser = argparse.ArgumentParser(prog="dsrecipes export", description=main.__doc__)
    parser.add_argument("run_dir", help="a run directory (holds config.yaml and checkpoints/)")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. step_100 (default: the newest complete)")
    parser.add_argument("--out", required=True, help="directory to write the Hugging Face model to")
    parser.add_argument("--lora", choices=["merged", "adapter"], default=None,
                        help="LoRA runs: merged model or adapter only (default: trainer.export_merged_lora)")
    args = parse(parser, argv)
    run_dir = Path(args.run_dir)
    root = run_dir / CHECKPOINTS
    tag_dir = root / args.tag if args.tag else latest_complete(root)
    if tag_dir is None or not (tag_dir / COMPLETE).is_file():
        raise UserError(f"{root}: no complete checkpoint{' ' + args.tag if args.tag else ''} to export")
    merge = None if args.lora is None else args.lora == "merged"
    out = export_checkpoint(run_dir, tag_dir, Path(args.out), merge_lora=merge)
    print(f"exported {tag_dir} -> {out}")
    return 0


main.__doc__ = "Write a Hugging Face model directory (safetensors, config, tokenizer) from a run's checkpoint."


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
