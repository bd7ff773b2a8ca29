"""A LLaMA-Factory experiment file in our keys: what `dsrecipes validate recipe=lf.yaml` prints under its problems, so
the file is rewritten by pasting once rather than by hand, line by line.

    in_our_keys({"learning_rate": 1e-4, "do_train": True, "quantization_bit": 4, "zero": "stage2"})
    -> "optimizer.lr: 0.0001\n# quantization_bit: 4\nzero: stage2\n"  (do_train: not needed here, dropped)

Each key of the file is one of: already ours (kept as written), another tool's key whose value carries over one to one
(`ours`: config/foreign_keys.RULES' plain renames and the value rules below), not needed here (dropped), or one a
person decides (no twin here, a value with no plain equivalent, a typo of ours: kept as a `#` comment, its problem
above says what to write). Nothing is written to disk:
the user's file stays theirs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from dsrecipes.config.foreign_keys import LF_REASONING, LF_SYSTEMS, LF_TEMPLATES, NOT_NEEDED, RULES, foreign_key
from dsrecipes.config.lf_differences import EOT_NEWLINE
from dsrecipes.config.trl_keys import TRL_VALUES, no_eval, trl_objective, trl_peft_defaults
from dsrecipes.core import choices

ALL_LINEAR = [choices.ALL_LINEAR]  # LLaMA-Factory's lora_target `all`: every linear layer but the output one, any model
_STAGES = {"sft": "sft", "dpo": "dpo", "rm": "reward"}


def _names(value: Any) -> List[str]:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


def _epochs(value: Any) -> Optional[Dict[str, Any]]:
    whole = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
    return {"trainer.epochs": int(value), "trainer.max_steps": None} if whole else None


def _deepspeed(value: Any) -> Optional[Dict[str, Any]]:
    found = re.search(r"z(?:ero)?_?([0-3])", str(value))
    if not found:
        return None
    return {"zero": f"stage{found.group(1)}", **({"offload": "cpu_optimizer"} if "offload" in str(value) else {})}


def _when_true(key: str, ours: Any) -> Callable[[Any], Optional[Dict[str, Any]]]:
    return lambda v: {key: ours} if v is True else {}


def _template(value: Any) -> Optional[Dict[str, Any]]:
    if str(value) not in LF_TEMPLATES or str(value) in LF_REASONING or str(value) == "sailor":  # no twin: a person
        return None  # decides (foreign_keys._reasoning, _template)
    system = {"template.default_system": LF_SYSTEMS[str(value)]} if str(value) in LF_SYSTEMS else {}
    return {"template": LF_TEMPLATES[str(value)] or "auto", **system, **_eot_newline(value)}


def _eot_newline(value: Any) -> Dict[str, Any]:
    """LLaMA-Factory trains the newline after the end-of-turn token of these templates with every reply (its
    format_assistant ends with it: chatml "{{content}}<|im_end|>\\n"): ours then do too (lf_differences.EOT_NEWLINE)."""
    return {"template.train_eot_newline": True} if str(value) in EOT_NEWLINE else {}


# LLaMA-Factory keys whose value decides our key or value (RULES' other callables: a note, or a person's decision)
VALUES: Dict[str, Callable[[Any], Optional[Dict[str, Any]]]] = {
    "stage": lambda v: {"objective": _STAGES[str(v)]} if str(v) in _STAGES else None,
    "finetuning_type": lambda v: {"model.lora.enabled": True} if v == "lora" else ({} if v == "full" else None),
    "lora_target": lambda v: {"model.lora.target_modules": ALL_LINEAR if str(v) == "all" else _names(v)},
    "dataset": lambda v: {"dataset.use": _names(v)},
    "dataset_dir": lambda v: {"dataset.registry": f"{v}/dataset_info.json"},
    "template": _template, "num_train_epochs": _epochs, "deepspeed": _deepspeed,
    "bf16": _when_true("precision", "bf16"), "pure_bf16": _when_true("precision", "bf16"),
    "fp16": _when_true("precision", "fp16"), "streaming": _when_true("data", "iterable"),
    "train_on_prompt": _when_true("data.train_on", "all"), "mask_history": _when_true("data.train_on", "last_assistant"),
    "neat_packing": _when_true("data.packing", True), "packing": _when_true("data.packing", True),
    "gradient_accumulation_steps": lambda v: {"trainer.grad_accum": v},
    "lr_scheduler_type": lambda v: {"scheduler": v} if v in ("cosine", "linear", "constant") else None,
    "resume_from_checkpoint": lambda v: {} if v is None else {"trainer.resume_from": v},
    "flash_attn": lambda v: {"model.attn_implementation": {"fa2": "flash_attention_2", "sdpa": "sdpa",
                                                            "disabled": "eager"}[str(v)]}
    if str(v) in ("fa2", "sdpa", "disabled") else {},
    **TRL_VALUES,
}


def ours(key: str, value: Any) -> Optional[Dict[str, Any]]:
    """Our keys and values for another tool's `key: value`: {} where it is not needed here, None where a person
    decides (and for a key no table knows)."""
    rule = RULES.get(key)
    if rule is None and key != "template":
        return None
    if isinstance(rule, str):
        return {rule: value}
    if key in VALUES:
        return VALUES[key](value)
    line = foreign_key(key, value) or ""
    return {} if line.startswith(NOT_NEEDED) else None


def read_together(data: Dict[str, Any]) -> Dict[str, Tuple[bool, str]]:
    """LLaMA-Factory keys of `data` whose meaning depends on another key of the same file (its DataArguments and
    loader read them together): {key: (a person decides: its line stays a `#` line, what its problem line adds)}."""
    out: Dict[str, Tuple[bool, str]] = {}
    if data.get("train_on_prompt") is True and data.get("mask_history") is True:
        both = ("but LLaMA-Factory refuses train_on_prompt: true with mask_history: true ('`mask_history` is "
                "incompatible with `train_on_prompt`'): choose one, data.train_on: all (every token) or last_assistant "
                "(the last reply)")
        out["train_on_prompt"] = out["mask_history"] = (True, both)
    if data.get("neat_packing") is True and data.get("packing") is not True and "packing" in data:
        out["packing"] = (False, "but LLaMA-Factory's neat_packing: true in this file turns packing on: data.packing: "
                                 "true")
    out.update(_steps_together(data))
    out.update(_groups_together(data))
    said = trl_objective(data)  # TRL's num_generations, precompute_ref_log_probs, ...: the trainer's objective
    if said:
        out[said[0]] = (False, f"a key of TRL's {said[1]} trainer, which picks the objective: objective: {said[1]}")
    out.update(_warmup_together(data))
    names, cap = _names(data.get("dataset") or ""), data.get("max_samples")
    if len(names) > 1 and isinstance(cap, int) and not isinstance(cap, bool):
        out["max_samples"] = (True, (
            f"but LLaMA-Factory's max_samples caps each dataset (the first {cap} rows of each of {', '.join(names)}: "
            f"up to {cap * len(names)}), and dataset.max_samples caps all sources together, in order (the first {cap} "
            f"rows in all: {', '.join(names[1:])} may not be read); for LLaMA-Factory's caps give each of those "
            f"entries \"num_samples\": {cap} in the dataset_info.json you give dsrecipes (read here as its first "
            f"{cap} rows), or max_samples: {cap} in a YAML registry (dataset.registry: FILE.yaml)"))
    return out


def _budget(value: Any) -> bool:
    """transformers' max_steps > 0: a step budget that wins over num_train_epochs (-1, its default: none)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _steps_together(data: Dict[str, Any]) -> Dict[str, Tuple[bool, str]]:
    """transformers' Trainer (LLaMA-Factory's and TRL's) trains max_steps when it is > 0, whatever num_train_epochs
    says, and num_train_epochs (3 by default there) when max_steps is -1, its default."""
    steps = data.get("max_steps")
    if "max_steps" not in data or (_budget(steps) and "num_train_epochs" not in data):
        return {}
    if _budget(steps):
        return {"num_train_epochs": (False, f"but this file's max_steps: {steps} wins over it (transformers' Trainer "
                                            f"trains max_steps when it is > 0): trainer.max_steps: {steps}")}
    epochs = data.get("num_train_epochs", 3)
    return {"max_steps": (False, f"but transformers' max_steps: {steps} means no step budget: it trains "
                                 f"num_train_epochs ({epochs}): trainer.max_steps: null with trainer.epochs")}


def _groups_together(data: Dict[str, Any]) -> Dict[str, Tuple[bool, str]]:
    """TRL's GRPOConfig: per_device_train_batch_size counts completions (whole groups of num_generations per
    generation batch); trainer.micro_batch_size counts prompts, each sampled objective.num_generations times."""
    size, group = data.get("per_device_train_batch_size"), data.get("num_generations")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (size, group)):
        return {}
    said = (f"but under TRL's GRPO per_device_train_batch_size counts completions ({size} = prompts x "
            f"num_generations {group}) and trainer.micro_batch_size counts prompts, each sampled "
            "objective.num_generations times")
    if size % group:
        return {"per_device_train_batch_size": (True, said + "; a group is one micro-batch's here: choose "
                                                        "trainer.micro_batch_size (prompts) and trainer.grad_accum")}
    return {"per_device_train_batch_size": (False, said + f": trainer.micro_batch_size: {size // group}")}


def _ratio(value: Any) -> bool:
    """transformers >= 5 reads a warmup_steps float in (0, 1) as a share of the run's steps (its warmup_ratio)."""
    return isinstance(value, float) and 0 < value < 1


def _warmup_together(data: Dict[str, Any]) -> Dict[str, Tuple[bool, str]]:
    """transformers' schedules warm up for warmup_steps (0 by default; a float below 1: a share of the steps), ours
    for scheduler.warmup_steps: 10 by default."""
    steps = data.get("warmup_steps")
    if _ratio(steps):
        return {"warmup_steps": (False, f"but transformers >= 5 reads a warmup_steps below 1 as a share of the "
                                        f"run's steps: scheduler.warmup_ratio: {steps}")}
    if "lr_scheduler_type" in data and "warmup_steps" not in data and "warmup_ratio" not in data:
        return {"lr_scheduler_type": (False, "but without warmup_steps transformers' schedule starts at the peak (no "
                                             "warmup) and ours warms up over scheduler.warmup_steps: 10 by default: "
                                             "scheduler.warmup_steps: 0")}
    return {}


def _steps(key: str, data: Dict[str, Any], mapped: Dict[str, Any]) -> Dict[str, Any]:
    """`mapped` for num_train_epochs and max_steps read together, as transformers' Trainer does (_steps_together)."""
    said = trl_objective(data)
    if said and said[0] == key:
        return {"objective": said[1], **mapped}
    if key == "num_train_epochs" and _budget(data.get("max_steps")):
        return {k: v for k, v in mapped.items() if k != "trainer.max_steps"}
    if key in ("eval_strategy", "evaluation_strategy") and no_eval(data[key]) and "val_size" not in data:
        return {"dataset.val_size": 0}  # transformers evaluates nothing: every row trains (trl_keys.eval_strategy)
    if key == "warmup_steps" and _ratio(data[key]):
        return {"scheduler.warmup_ratio": data[key]}
    if key == "lr_scheduler_type" and "lr_scheduler_type" in _warmup_together(data):
        return {**mapped, "scheduler.warmup_steps": 0}
    if key == "per_device_train_batch_size" and _groups_together(data):  # a whole number of groups: else a `#` line
        return {"trainer.micro_batch_size": data[key] // data["num_generations"]}
    if key == "max_steps" and not _budget(data["max_steps"]):
        return {"trainer.max_steps": None} if "num_train_epochs" in data else {"trainer.max_steps": None,
                                                                                  "trainer.epochs": 3}
    return mapped


def in_our_keys(data: Dict[str, Any], problems: Dict[str, str]) -> Optional[str]:
    """The file `data` (its top-level keys, in order) in our keys, as YAML text; `problems`: {top-level key: its
    problem} (a key without one is ours already). None when no key of another tool was translated (a typo of ours:
    the problems say it all)."""
    out: List[str] = []
    translated = False
    written = {str(k) for k in data if str(k) not in problems}  # the user's own keys win over a translation
    together = read_together(data)
    for key, value in data.items():
        key = str(key)
        if key not in problems:  # LF's `template: chatml` is ours by name: kept, its newline trained as in LF
            extra = _eot_newline(value) if key == "template" else {}
            out.extend(_yaml({k: v}) for k, v in {key: value, **extra}.items() if k == key or k not in written)
            written.update(extra)
            continue
        mapped = None if together.get(key, (False, ""))[0] else ours(key, value)
        if mapped is None:  # no twin here, or a typo of ours: the problem above says what to write
            out.append("".join(f"# {line}\n" for line in _yaml({key: value}).splitlines()))
            continue
        translated = True
        mapped = _steps(key, data, mapped)
        if key == "finetuning_type" and value == "lora":
            mapped = {**mapped, **lf_lora_defaults(data)}
        if key == "use_peft" and value is True:  # TRL's LoRA, where the file is silent
            mapped = {**mapped, **trl_peft_defaults(data)}
        if key == "template" and "default_system" in data:  # the file's own default_system wins, as in LF
            mapped = {k: v for k, v in mapped.items() if k != "template.default_system"}
        out.extend(_yaml({k: v}) for k, v in mapped.items() if k not in written)
        written.update(mapped)  # a key once: `deepspeed: ds_z3.json` beside `zero: stage3`
    return "".join(out) if translated else None


def lf_lora_defaults(data: Dict[str, Any]) -> Dict[str, Any]:
    """What LLaMA-Factory's LoRA uses where its file is silent and ours differs: lora_target `all`, lora_alpha
    2 x lora_rank, lora_dropout 0 (ours: q/k/v/o_proj, 16, 0.05), so the translated file trains the same adapter."""
    out: Dict[str, Any] = {}
    if "lora_target" not in data:
        out["model.lora.target_modules"] = ALL_LINEAR
    rank = data.get("lora_rank", 8)
    if "lora_alpha" not in data and isinstance(rank, int) and not isinstance(rank, bool):
        out["model.lora.alpha"] = 2 * rank
    if "lora_dropout" not in data:
        out["model.lora.dropout"] = 0.0
    return out


def _yaml(item: Dict[str, Any]) -> str:
    """`key: value` lines; a list of plain values on one line (`[q_proj, v_proj]`), as LLaMA-Factory files write it."""
    ((key, value),) = item.items()
    if isinstance(value, list) and not any(isinstance(v, (dict, list)) for v in value):
        flow = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=1000).strip()
        return f"{yaml.safe_dump(key).splitlines()[0]}: {flow}\n"
    return yaml.safe_dump(item, default_flow_style=False, sort_keys=False, allow_unicode=True, width=1000)


def lf_command_file(arg: str, command: str) -> Optional[str]:
    """`dsrecipes chat|export FILE.yaml` given LLaMA-Factory's inference or export file (`llamafactory-cli chat
    FILE.yaml`): the command to type here, from its adapter_name_or_path (else model_name_or_path) and export_dir;
    None for anything else. Reads a regular file of at most 1 MiB, its top-level keys only."""
    path = Path(arg).expanduser()
    try:
        if path.suffix not in (".yaml", ".yml") or not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if not isinstance(data, dict) or "model_name_or_path" not in data:
        return None
    model = data.get("adapter_name_or_path") or data.get("model_name_or_path")
    model = model if isinstance(model, str) and model else "RUN"
    if command == "export":
        out = data.get("export_dir") if isinstance(data.get("export_dir"), str) else "DIR"
        here = (f"dsrecipes export {model} --out {out} (a run directory or one of its checkpoints; a LoRA run is "
                "merged unless --lora adapter)")
    else:
        here = (f"dsrecipes {command} {model} (a run directory, its export or a model directory; the template is the "
                "one the run trained with)")
    return f"{arg}: a LLaMA-Factory {command} file; dsrecipes {command} takes the model itself: {here}"
