"""Keys people bring from TRL scripts (SFTConfig, DPOConfig, RewardConfig, GRPOConfig, and the LoRA keys of TRL's
ModelConfig) -> the dsrecipes key with their value, or what to write instead and why. The keys TRL shares with
LLaMA-Factory (Hugging Face TrainingArguments: learning_rate, per_device_train_batch_size, ...) are in
config/foreign_keys.py, which merges these tables into its own:

    TRL_RENAMES["max_length"]                 -> "data.cutoff_len"  (the value carries over)
    TRL_RULES["assistant_only_loss"](False)   -> "TRL's key; here: data.train_on: all (...)"
    TRL_VALUES["assistant_only_loss"](False)  -> {"data.train_on": "all"}  (the translated file, config/lf_translate.py)

What TRL does with each key is read from TRL's source (trl/trainer/*_config.py, model_config.py), not guessed.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

TRL = "TRL's key; here: "
# transformers' TrainingArguments: the keys a LLaMA-Factory file and a TRL script (SFTConfig, DPOConfig, ...) share
TRAINING_ARGUMENTS = frozenset((
    "output_dir", "logging_steps", "save_steps", "save_total_limit", "report_to", "overwrite_output_dir",
    "save_only_model", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
    "num_train_epochs", "max_steps", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay",
    "max_grad_norm", "seed", "bf16", "fp16", "deepspeed", "gradient_checkpointing", "resume_from_checkpoint",
    "dataloader_num_workers", "ddp_timeout", "optim", "adam_beta1", "adam_beta2", "adam_epsilon",
    "lr_scheduler_kwargs", "run_name", "logging_dir", "per_device_eval_batch_size", "eval_strategy",
    "evaluation_strategy", "eval_steps", "save_strategy", "load_best_model_at_end", "metric_for_best_model",
    "eval_on_start", "include_num_input_tokens_seen", "dataloader_pin_memory", "do_train", "do_eval", "do_predict"))
TRANSFORMERS = "transformers' key (LLaMA-Factory, TRL); here: "


def relabel(key: str, line: str, lf_prefix: str) -> str:
    """`line` (a foreign key's, starting with `lf_prefix`: LLaMA-Factory's key) as transformers' key where `key` is
    one of TrainingArguments, which a TRL script sets as much as a LLaMA-Factory file."""
    return TRANSFORMERS + line[len(lf_prefix):] if key in TRAINING_ARGUMENTS and line.startswith(lf_prefix) else line


NOT_NEEDED = "not needed here: "

# TRL's key -> ours, the value carries over one to one
TRL_RENAMES = {
    "max_length": "data.cutoff_len", "max_seq_length": "data.cutoff_len", "lora_r": "model.lora.r",
    "lora_target_modules": "model.lora.target_modules", "seed": "trainer.seed", "beta": "objective.beta",
    "label_smoothing": "objective.label_smoothing", "num_generations": "objective.num_generations",
    "max_completion_length": "objective.max_completion_length", "temperature": "objective.temperature",
    "epsilon": "objective.epsilon", "center_rewards_coefficient": "objective.center_rewards_coefficient",
    "dataset_num_proc": "data.preprocess_workers",
}

ALL_TURNS = ("data.train_on: all (every token of the conversation, TRL's default; ours, data.train_on: assistant, "
             "trains the assistant turns only)")
PROMPT_COMPLETION = ("TRL's prompt/completion rows are read by dataset=openai_messages: the prompt as context, the "
                     "completion as the trained answer")


def _one(value: Any) -> Any:
    """TRL's loss_type is a list in DPOConfig (several losses, weighted): one value stands for itself."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def _loss_type(value: Any) -> str:
    value = _one(value)
    if value in ("sigmoid", "ipo", "robust", "simpo"):
        return TRL + f"objective.loss: {value} (with objective=dpo)"
    if value in ("nll", "chunked_nll"):
        return NOT_NEEDED + "objective=sft trains the next-token NLL of the trained tokens"
    if value == "dapo":
        return NOT_NEEDED + "objective=grpo's loss is TRL's loss_type: dapo (clipped, per token over the step's tokens)"
    return (f"no {value} loss here (objective=dpo: objective.loss: sigmoid, ipo, robust, simpo; objective=orpo; "
            "objective=grpo trains TRL's dapo loss; objective=sft the NLL)")


def _assistant_only(value: Any) -> str:
    if value is True:
        return NOT_NEEDED + "data.train_on: assistant (the assistant turns only) is the default here"
    return TRL + ALL_TURNS


def _completion_only(value: Any) -> str:
    if value is False:
        return TRL + (f"data.train_on: all (prompt and completion; an assistant turn inside a prompt list stays "
                      f"untrained, unlike TRL); {PROMPT_COMPLETION}")
    return (NOT_NEEDED + "data.train_on: assistant (the default) trains the answer turns only, as TRL's completion-only "
            f"loss does; {PROMPT_COMPLETION}")


def _use_peft(value: Any) -> str:
    if value is not True:
        return NOT_NEEDED + "full fine-tuning is the default (model.lora.enabled: false)"
    return TRL + ("model.lora.enabled: true (unset, TRL's LoRA is lora_r: 16, lora_alpha: 32, lora_dropout: 0.05 on "
                  "peft's default modules for the model, [q_proj, v_proj] for Llama/Qwen/Mistral; ours is "
                  "model.lora.r: 8, model.lora.alpha: 16, model.lora.target_modules: [q_proj, k_proj, v_proj, o_proj]: "
                  "set them for the same adapter)")


def _precompute(value: Any) -> str:
    if value is True:
        return NOT_NEEDED + "objective.reference: precomputed (once before training, cached) is the default here"
    return TRL + ("objective.reference: live (a frozen reference beside the trained model, TRL's default) or keep "
                  "ours, precomputed: the same reference log-probs, computed once before training")


def _reference_free(value: Any) -> str:
    if value is not True:
        return NOT_NEEDED + "objective=dpo always has a reference (objective.reference: precomputed or live)"
    return ("no reference-free sigmoid DPO here (TRL's reference_free: a zero reference); the reference-free losses "
            "here are objective.loss: simpo (average log-prob margin, objective.simpo_gamma) and objective=orpo")


def _max_prompt_length(value: Any) -> str:
    return (f"no prompt cap of its own here ({value}): data.cutoff_len caps prompt + answer; objective=dpo and "
            "objective=reward cut a long pair's prompt to its tail (at least cutoff_len / 2 tokens, the answers keep "
            "their head), objective=grpo refuses a prompt longer than data.cutoff_len - "
            "objective.max_completion_length (set data.cutoff_len to max_prompt_length + max_completion_length)")


def _dataset_text_field(value: Any) -> str:
    return (f"no plain-text (language-modeling) rows here, no `{value}` column: rows are conversations "
            "(dataset=openai_messages reads TRL's `messages`; dataset.columns.messages names another column); for "
            "continued pre-training on text, write each text as one assistant turn and train it with data.train_on: all")


def _dataset_name(value: Any) -> str:
    return (f"dataset=openai_messages with dataset.paths: [{value}] (local JSON/JSONL/Parquet files of TRL's messages, "
            "prompt/chosen/rejected or prompt rows; a Hub dataset: save it to a file first, e.g. "
            "datasets' to_json)")


def _reward_funcs(value: Any) -> str:
    return ("objective.rewards: [{name: exact_match}, ...] (built-in by name: exact_match, number_equal, regex, length; "
            "your own function: a package registering it under the entry point group dsrecipes.rewards; a reward "
            "model: objective.reward_model: DIR); no import paths in a recipe")


def no_eval(value: Any) -> bool:
    """eval_strategy: no (YAML reads a bare `no` as false)."""
    return value is False or str(value) == "no"


def eval_strategy(value: Any) -> str:
    """transformers' eval_strategy (TRL's and LLaMA-Factory's): `no` evaluates nothing, and TRL without an
    eval_dataset trains every row; here dataset.val_size holds rows out for evaluation unless it is 0."""
    if no_eval(value):
        return ("transformers' eval_strategy: no evaluates nothing; here: dataset.val_size: 0 (no validation split, no "
                "evaluation: every row trains, as in TRL without an eval_dataset; dataset.val_size holds rows out by "
                "default), unless the file's val_size holds some out")
    return NOT_NEEDED + "evaluation runs every trainer.eval_every steps (0: only at the end)"


def _trackers(value: Any) -> list:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip() and str(v).strip() != "none"]


def report_to(value: Any) -> str:
    """transformers' report_to (TRL's, LLaMA-Factory's): `all` is every installed integration, none here."""
    names = _trackers(value)
    if "all" in names:
        return ("transformers' report_to: all (every installed integration) has no twin here: name them, "
                "trainer.report_to: [tensorboard, mlflow, wandb] (a list of those)")
    return TRANSFORMERS + f"trainer.report_to: [{', '.join(names)}] (a list of tensorboard, mlflow, wandb)"


def _sampling(key: str, default: Any) -> Callable[[Any], str]:
    def rule(value: Any) -> str:
        if value in default:
            return NOT_NEEDED + "objective=grpo samples from the whole distribution at objective.temperature"
        return f"no {key} here: objective=grpo samples from the whole distribution at objective.temperature"
    return rule


def _scale_rewards(value: Any) -> str:
    if value in ("group", True):
        return NOT_NEEDED + "objective=grpo divides advantages by their group's std + 1e-4 (TRL's scale_rewards: group)"
    return (f"no scale_rewards: {value} here: objective=grpo divides advantages by their group's std + 1e-4 (TRL's "
            "default, group)")


# TRL's keys whose value decides our line
TRL_RULES: Dict[str, Callable[[Any], str]] = {
    "loss_type": _loss_type, "assistant_only_loss": _assistant_only, "completion_only_loss": _completion_only,
    "use_peft": _use_peft, "precompute_ref_log_probs": _precompute, "reference_free": _reference_free,
    "max_prompt_length": _max_prompt_length, "dataset_text_field": _dataset_text_field,
    "dataset_name": _dataset_name, "reward_funcs": _reward_funcs,
    "num_iterations": lambda v: NOT_NEEDED + "objective=grpo optimises once per generation (TRL's num_iterations: 1)"
    if v == 1 else f"no num_iterations {v} here: objective=grpo optimises once per generation (TRL's default, 1)",
    "ref_model": lambda v: NOT_NEEDED + "the reference is model.path (the base model under LoRA)",
    "remove_unused_columns": lambda v: NOT_NEEDED + "rows are read by their columns (dataset.columns)",
    "logging_first_step": lambda v: NOT_NEEDED + "the first logged step is trainer.log_every",
    "rpo_alpha": lambda v: ("no SFT term in objective=dpo here (TRL's rpo_alpha weighs the chosen answers' NLL); "
                            "objective: orpo adds the chosen answers' NLL, with the odds-ratio term instead of DPO's"),
    "use_vllm": lambda v: ("no vLLM here: " if v is True else NOT_NEEDED) + "objective=grpo samples with the trained "
    "policy itself on each rank (ZeRO-3: its parameters gathered for the sampling)",
    "scale_rewards": _scale_rewards, "top_p": _sampling("top_p", (1.0, None)),
    "top_k": _sampling("top_k", (0, None)), "min_p": _sampling("min_p", (0.0, None)),
    "repetition_penalty": _sampling("repetition_penalty", (1.0, None)),
}


# TRL's keys whose value decides our keys, for the translated file: {} not needed here, None a person decides
TRL_VALUES: Dict[str, Callable[[Any], Optional[Dict[str, Any]]]] = {
    "loss_type": lambda v: {"objective.loss": _one(v)} if _one(v) in ("sigmoid", "ipo", "robust", "simpo") else (
        {} if _one(v) in ("nll", "chunked_nll", "dapo") else None),
    "assistant_only_loss": lambda v: {} if v is True else {"data.train_on": "all"},
    "use_peft": lambda v: {"model.lora.enabled": True} if v is True else {},
    "precompute_ref_log_probs": lambda v: {} if v is True else {"objective.reference": "live"},
    "report_to": lambda v: None if "all" in _trackers(v) else {"trainer.report_to": _trackers(v)},
    "eval_strategy": lambda v: {}, "evaluation_strategy": lambda v: {},  # `no`: lf_translate._steps, with val_size
}


# TRL's keys only one trainer reads -> our objective: TRL picks the objective by its trainer class, so a TRL file
# says it only through them (config/objective_rules.READ_BY refuses them under another objective)
TRL_OBJECTIVE_KEYS = {
    **dict.fromkeys(("num_generations", "max_completion_length", "reward_funcs", "use_vllm", "scale_rewards",
                     "num_iterations"), "grpo"),
    **dict.fromkeys(("precompute_ref_log_probs", "rpo_alpha", "reference_free"), "dpo"),
    "center_rewards_coefficient": "reward",
}


def trl_objective(data: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """(the first key of a TRL file that says its objective, that objective), for a file that names none itself
    (`objective`, or LLaMA-Factory's `stage`); None for any other file."""
    if "objective" in data or "stage" in data:
        return None
    said = [(str(key), TRL_OBJECTIVE_KEYS[str(key)]) for key in data if str(key) in TRL_OBJECTIVE_KEYS]
    kinds = {kind for _, kind in said}
    return said[0] if len(kinds) == 1 else None


def trl_peft_defaults(data: Dict[str, Any]) -> Dict[str, Any]:
    """TRL's LoRA where its file is silent and ours differs (ModelConfig: lora_r 16, lora_alpha 32; peft's default
    modules for Llama-family models), so the translated file trains the same adapter."""
    out: Dict[str, Any] = {}
    if "lora_r" not in data:
        out["model.lora.r"] = 16
    if "lora_alpha" not in data:
        out["model.lora.alpha"] = 32
    if "lora_target_modules" not in data:
        out["model.lora.target_modules"] = ["q_proj", "v_proj"]
    return out
