"""Export to a Hugging Face model directory (safetensors, config, tokenizer): from a checkpoint of any ZeRO stage, or
the embedded tiny model's seeded start (the prompt-eval baseline). One process; no process group needed. Every
export is made ready to serve first (serving.py: the training template as the tokenizer's chat template, end-of-turn
stop tokens, use_cache); an adapter-only LoRA export names its base model in adapter_config.json.

The destination belongs to the user until proven ours: it must be absent, an empty directory, or an earlier
dsrecipes export holding nothing but the files that export wrote (`dsrecipes_export.json` lists them); anything
else is refused before any work (exit 2, nothing touched). The marker also holds each file's size and hash and is
signed with this user's key (trust.py), so chat and prompt-eval on a run directory load only what this user wrote. The new directory is written beside the destination
under a fresh name and renamed into place; an earlier export is swapped out and only then deleted.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch

import dsrecipes.core.disk_space as disk_space
import dsrecipes.core.manifest as manifest
from dsrecipes.boundary.checkpoint_find import verified
from dsrecipes.boundary.point_of_use import CheckedCheckpoint, reading
from dsrecipes.boundary.safe_load import load
from dsrecipes.boundary.trust import sign
from dsrecipes.config.load import load_run_config
from dsrecipes.core.console import kept_in_log
from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.errors import UserError
from dsrecipes.core.export_dir import EXPORT_INIT_DIR, EXPORT_MARKER, check_out_dir
from dsrecipes.core.fileio import atomic_write_json
from dsrecipes.core.publish import Existing, publish_dir, staging_dir, stale_staging
from dsrecipes.core.rundir import MARKER_FILE
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.tokenizer import custom_code_problems
from dsrecipes.data.render.serving import make_servable
from dsrecipes.modeling.model import TORCH_DTYPES, build_model, build_tiny_model, load_tokenizer


def export_initial(cfg: TrainConfig, tokenizer: Any, out_dir: Path) -> Path:
    """The embedded tiny model's seeded start, as a HF directory: the baseline for `dsrecipes prompt-eval`, and the
    base of the tiny model's adapter-only LoRA exports."""

    check_out_dir(out_dir)
    tokenizer = copy.deepcopy(tokenizer)  # the caller's (training) tokenizer keeps its chat template
    model = build_tiny_model(cfg, tokenizer)
    info = {"source": "initial weights (model.tiny.seed)", "step": 0, **make_servable(model, tokenizer, cfg)}
    return _save_hf(model, tokenizer, out_dir, info)


def export_checkpoint(run_dir: Path, tag_dir: Path, out_dir: Path, cfg: Optional[TrainConfig] = None,
                      merge_lora: Optional[bool] = None, key: str = "export",
                      retry: str = "dsrecipes export RUN --out DIR") -> Path:
    """Checkpoint -> HF model directory (safetensors + config + tokenizer with its chat template), any ZeRO stage.

    Weights: ZeRO-0/1/2 keep the full module in `mp_rank_00_model_states.pt`; ZeRO-3 shards are consolidated with
    DeepSpeed's zero_to_fp32. LoRA runs write the merged model or the adapter only (`merge_lora`, by default
    `trainer.export_merged_lora`). Nothing is read from the checkpoint before checkpoint_find.verified passed
    (signed by this user or trusted on the command line, every file as written; `retry` is named if not).
    """

    check_out_dir(out_dir, key)
    with reading(tag_dir):  # a run still writing it keeps it until this is read (its retention passes it over)
        verified(tag_dir, retry)
        checked = CheckedCheckpoint.open(tag_dir)  # what is loaded below is checked again right before it is
        cfg = cfg or load_run_config(run_dir)
        if cfg.model.path:  # the base the weights go onto: never a directory that needs its own code
            for problem in custom_code_problems("model.path", Path(cfg.model.path)):
                raise UserError(problem)
        tokenizer = load_tokenizer(cfg)
        frozen_excluded = bool(checked.record.get("frozen_excluded"))
        state_dict = consolidated_state_dict(tag_dir, cfg.zero.stage, frozen_excluded, checked)
        checked.close()
    model = build_model(cfg, tokenizer)  # skeleton on CPU; real models re-read from model.path, then overwritten
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # A LoRA checkpoint leaves the frozen base out: those weights stay as built from model.path (or the tiny seed).
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad} if frozen_excluded else set()
    missing = [k for k in missing if not _is_tied(model, k) and k not in frozen]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {tag_dir} does not match the model: missing {missing}, unexpected {unexpected}")
    info = {"source": str(tag_dir), "step": checked.record["step"], "run_dir": str(Path(run_dir).resolve())}
    merge_lora = cfg.trainer.export_merged_lora if merge_lora is None else merge_lora
    if cfg.model.lora.enabled and merge_lora:
        model = model.merge_and_unload()
        info["lora"] = "merged"
    elif cfg.model.lora.enabled:
        info.update(lora="adapter", base_model=_adapter_base(cfg, model, tokenizer, Path(run_dir)))
    info.update(make_servable(model, tokenizer, cfg))  # training template, end-of-turn stops, use_cache
    model.to(TORCH_DTYPES[cfg.precision.dtype])
    return _save_hf(model, tokenizer, out_dir, info, key)


def _adapter_base(cfg: TrainConfig, model: Any, tokenizer: Any, run_dir: Path) -> str:
    """The base model an adapter-only export applies to, recorded in adapter_config.json so peft (and prompt-eval,
    chat) can load it: model.path, or for the embedded tiny model its seeded start `RUN/export_init`."""
    base = cfg.model.path
    if base is not None and Path(base).is_dir():  # a local directory as typed (runs/sft/export): peft, chat and a
        base = os.path.abspath(base)  # server read it from elsewhere; a hub id stays as it is
    if base is None:
        base_dir = run_dir.resolve() / EXPORT_INIT_DIR
        if not (base_dir / "config.json").is_file():
            export_initial(cfg, tokenizer, base_dir)
        base = str(base_dir)
    for peft_config in model.peft_config.values():
        peft_config.base_model_name_or_path = base
    return base


def consolidated_state_dict(tag_dir: Path, zero_stage: int, frozen_excluded: bool = False,
                            checked: Optional[CheckedCheckpoint] = None) -> Dict[str, torch.Tensor]:
    """The module's weights; `checked`: each file is checked against the signed record right before it is read."""
    checked = checked or CheckedCheckpoint.open(tag_dir)
    if zero_stage == 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with checked.guard(), kept_in_log():  # zero_to_fp32 unpickles with weights_only=False; prints, draws bars
            return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name,
                                                            exclude_frozen_parameters=frozen_excluded)

    return load(tag_dir / "mp_rank_00_model_states.pt", checked)["module"]  # weights_only: tensors and data only


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    # zero_to_fp32 and safetensors-style dicts may drop the second name of a tied (shared) parameter.
    params = dict(model.named_parameters(remove_duplicate=False))
    tensor = params.get(key)
    return tensor is not None and sum(p is tensor for p in params.values()) > 1


def _save_hf(model: Any, tokenizer: Any, out_dir: Path, info: Dict[str, Any], key: str = "export") -> Path:
    out_dir = Path(out_dir)
    check_out_dir(out_dir, key)
    load_deepspeed()  # save_pretrained imports DeepSpeed (accelerate's unwrap): first without its autotuner's mlflow
    try:  # after that import: a Ctrl-C during it left an empty staging directory behind
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        if (out_dir.parent / MARKER_FILE).is_file():  # a run directory (ours): what an export killed there left
            for stale in stale_staging(out_dir):  # (its rank SIGKILLed mid-write: a hidden model-sized copy)
                shutil.rmtree(stale, ignore_errors=True)
        tmp = staging_dir(out_dir)
    except OSError as exc:  # /proc/x as root passes check_out_dir's os.access; a read-only mount; a race
        raise UserError(f"{key}: cannot create {out_dir} ({exc.strerror or exc}); nothing was changed") from None
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        generation = getattr(model.get_base_model(), "generation_config", None) if hasattr(
            model, "get_base_model") else None  # an adapter-only export: peft writes no generation_config.json
        if generation is not None:  # (a reward model's scoring head generates nothing: it has none)
            generation.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _user_modes(tmp)
        hashes = manifest.describe(tmp)
        atomic_write_json(tmp / EXPORT_MARKER, sign({**info, "files": sorted(hashes), "hashes": hashes}))
        _swap_in(tmp, out_dir, key)
    except BaseException as exc:
        written = disk_space.tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and disk_space.out_of_space(exc, out_dir.parent):
            needed = max(written, sum(t.numel() * t.element_size() for t in model.state_dict().values()))
            raise disk_space.ExportOutOfSpace(
                disk_space.describe(key, out_dir, needed, True, disk_space.free_bytes(out_dir.parent))
                + "; the partial export was removed and nothing else was changed") from None
        raise
    return out_dir


def _user_modes(tmp: Path) -> None:
    """mkdtemp makes 0700 and some writers 0600 files: an export is an ordinary directory of the user's, with the
    modes their umask gives (the marker, written next by plain open(), gets them too)."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(tmp):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o777 & ~mask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


def _swap_in(tmp: Path, out_dir: Path, key: str) -> None:
    """Publish `tmp` as `out_dir` (core/publish.py): one rename when that is absent or empty, else the earlier export
    (checked again: it may have changed during the export) is exchanged with it in one step and then deleted."""
    try:
        publish_dir(tmp, out_dir, Existing.refuse)
        return
    except FileExistsError:
        check_out_dir(out_dir, key)
    previous = publish_dir(tmp, out_dir, Existing.exchange)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
