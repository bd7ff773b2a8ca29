"""DeepSpeed-Chat's training options (applications/DeepSpeed-Chat/training/step{1,2,3}_*/main.py argparse flags), as
people bring them to a recipe file or the command line (`data_split=2,4,4`): one line each, dsrecipes' spelling
(config/foreign_keys.py merges this table; its own keys win). Flags shared with transformers
(per_device_train_batch_size, gradient_accumulation_steps, learning_rate, weight_decay, num_train_epochs, seed,
output_dir) are foreign_keys' own."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

DSCHAT = "DeepSpeed-Chat's option; here: "
STAGES = ("sft", "reward", "rl")  # DeepSpeed-Chat's three steps, in its --data_split order


def _numbers(value: Any) -> List[str]:
    items = value if isinstance(value, (list, tuple)) else str(value).replace(" ", "").split(",")
    return [str(v) for v in items if str(v)]


def _data_split(value: Any) -> str:
    shares = ",".join(f"{name}:{weight}" for name, weight in zip(STAGES, _numbers(value)))
    return (DSCHAT + f"'++dataset.split.shares={{{shares}}}' (one split of the data, shares named by their stage; "
            "each stage of a pipeline file takes its own with dataset.split.take: NAME, README: Pipelines)")


def _zero_stage(value: Any) -> str:
    return DSCHAT + f"zero=stage{value} (the DeepSpeed JSON is generated from the zero, offload and precision groups)"


DSCHAT_RULES: Dict[str, Callable[[Any], str]] = {
    "data_split": _data_split,
    "data_path": lambda v: DSCHAT + f"dataset.paths: {v} (local files or globs, s3:// or hf://datasets/ORG/NAME/FILE)",
    "data_output_path": lambda v: "not needed here: prepared data is cached by content under data.cache_dir",
    "max_seq_len": lambda v: DSCHAT + f"data.cutoff_len: {v}",
    "max_prompt_seq_len": lambda v: DSCHAT + f"data.cutoff_len: {v} bounds prompt and answer together; GRPO's "
    "answers: objective.max_completion_length",
    "max_answer_seq_len": lambda v: DSCHAT + f"objective.max_completion_length: {v} (objective=grpo)",
    "num_warmup_steps": lambda v: DSCHAT + f"scheduler.warmup_steps: {v}",
    "zero_stage": _zero_stage,  # (--offload: our offload group's own name; offload=cpu_optimizer_params is its twin)
    "lora_dim": lambda v: DSCHAT + f"model.lora.r: {v} (with model.lora.enabled: true)",
    "lora_module_name": lambda v: DSCHAT + "model.lora.target_modules: [NAMES] (module names; [all-linear]: every "
    "linear layer but the output head)",
    "only_optimize_lora": lambda v: "not needed here: model.lora.enabled: true trains the adapters alone",
    "num_padding_at_beginning": lambda v: "not needed here: a reward model's score is read at each sequence's last "
    "real token (right padding)",
    "enable_tensorboard": lambda v: "not needed here: every run writes TensorBoard events to RUN/tb "
    "(trainer.report_to)",
    "dtype": lambda v: DSCHAT + "precision=bf16|fp16|fp32",
    "actor_model_name_or_path": lambda v: DSCHAT + f"model.path: {v} (the policy objective=grpo trains)",
    "critic_model_name_or_path": lambda v: DSCHAT + f"objective.reward_model: {v} (GRPO needs no critic: the reward "
    "model scores, group-relative advantages replace the value head)",
    "print_loss": lambda v: "not needed here: the loss is logged every trainer.log_every steps",
}
