"""Export to a Hugging Face model directory (safetensors, config, tokenizer): from a checkpoint of any ZeRO stage, or
the embedded tiny model's seeded start (the prompt-eval baseline). One process; no process group needed. Every
export is made ready to serve first (serving.py: the training template as the tokenizer's chat template, end-of-turn
stop tokens, use_cache); an adapter-only LoRA export names its base model in adapter_config.json.

The directory is written beside its destination and renamed into place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from dsrecipes.checkpoint import step_of
from dsrecipes.config.schema import TrainConfig
from dsrecipes.fileio import atomic_write_json

EXPORT_DIR = "export"
EXPORT_INIT_DIR = "export_init"
EXPORT_INFO = "dsrecipes_export.json"  # where an export came from: run, step, template, an adapter's base model

def export_initial(cfg: TrainConfig, tokenizer: Any, out_dir: Path) -> Path:
    """The embedded tiny model's seeded start, as a HF directory: the baseline for `dsrecipes prompt-eval`, and the
    base of the tiny model's adapter-only LoRA exports."""
    import copy

    from dsrecipes.model import build_tiny_model
    from dsrecipes.serving import make_servable

    tokenizer = copy.deepcopy(tokenizer)  # the caller's (training) tokenizer keeps its chat template
    model = build_tiny_model(cfg, tokenizer)
    info = {"source": "initial weights (model.tiny.seed)", "step": 0, **make_servable(model, tokenizer, cfg)}
    return _save_hf(model, tokenizer, out_dir, info)


def export_checkpoint(run_dir: Path, tag_dir: Path, out_dir: Path, cfg: Optional[TrainConfig] = None,
                      merge_lora: Optional[bool] = None) -> Path:
    """Checkpoint -> HF model directory (safetensors + config + tokenizer with its chat template), any ZeRO stage.

    Weights: ZeRO-0/1/2 keep the full module in `mp_rank_00_model_states.pt`; ZeRO-3 shards are consolidated with
    DeepSpeed's zero_to_fp32. LoRA runs write the merged model or the adapter only (`merge_lora`, by default
    `trainer.export_merged_lora`).
    """
    from dsrecipes.config.load import load_run_config
    from dsrecipes.model import TORCH_DTYPES, build_model, load_tokenizer
    from dsrecipes.serving import make_servable

    cfg = cfg or load_run_config(run_dir)
    tokenizer = load_tokenizer(cfg)
    state_dict = consolidated_state_dict(tag_dir, cfg.zero.stage)
    model = build_model(cfg, tokenizer)  # skeleton on CPU; real models re-read from model.path, then overwritten
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {tag_dir} does not match the model: missing {missing}, unexpected {unexpected}")
    info = {"source": str(tag_dir), "step": step_of(tag_dir), "run_dir": str(Path(run_dir).resolve())}
    merge_lora = cfg.trainer.export_merged_lora if merge_lora is None else merge_lora
    if cfg.model.lora.enabled and merge_lora:
        model = model.merge_and_unload()
        info["lora"] = "merged"
    elif cfg.model.lora.enabled:
        info.update(lora="adapter", base_model=_adapter_base(cfg, model, tokenizer, Path(run_dir)))
    info.update(make_servable(model, tokenizer, cfg))  # training template, end-of-turn stops, use_cache
    model.to(TORCH_DTYPES[cfg.precision.dtype])
    return _save_hf(model, tokenizer, out_dir, info)


def _adapter_base(cfg: TrainConfig, model: Any, tokenizer: Any, run_dir: Path) -> str:
    """The base model an adapter-only export applies to, recorded in adapter_config.json so peft (and prompt-eval,
    chat) can load it: model.path, or for the embedded tiny model its seeded start `RUN/export_init`."""
    base = cfg.model.path
    if base is None:
        base_dir = run_dir.resolve() / EXPORT_INIT_DIR
        if not (base_dir / "config.json").is_file():
            export_initial(cfg, tokenizer, base_dir)
        base = str(base_dir)
    for peft_config in model.peft_config.values():
        peft_config.base_model_name_or_path = base
    return base


def consolidated_state_dict(tag_dir: Path, zero_stage: int) -> Dict[str, torch.Tensor]:
    if zero_stage == 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

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
    if hasattr(model, "get_base_model"):  # an adapter-only export: peft writes no generation_config.json
        model.get_base_model().generation_config.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    atomic_write_json(tmp / EXPORT_INFO, info)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
