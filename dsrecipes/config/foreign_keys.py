"""Keys people bring from LLaMA-Factory experiment files (and Hugging Face TrainingArguments) -> one line each: the
dsrecipes spelling, with their value where it carries over, or why the key is not needed here.

    foreign_key("learning_rate", 1e-4)   -> "transformers' key (LLaMA-Factory, TRL); here: optimizer.lr: 0.0001"
    foreign_key("stage", "dpo")          -> "LLaMA-Factory's stage is the objective; here: objective: dpo (...)"
    foreign_key("do_train", True)        -> "not needed here: ..."
    foreign_key("trainer", {...})        -> None (not a key of another tool)

A flat recipe file (config/flat_check.py) reports every such key of a file at once; the command line's
`learning_rate=...` gets the plain key through hints.FROM_OTHER_TOOLS.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Dict, Optional, Union

import dsrecipes.config.lf_differences as lf_differences
from dsrecipes.config.dschat_keys import DSCHAT_RULES
from dsrecipes.config.trl_keys import NOT_NEEDED, TRL, TRL_RENAMES, TRL_RULES, eval_strategy, relabel, report_to

HERE = "LLaMA-Factory's key; here: "

Rule = Union[str, Callable[[Any], str]]


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value)


def _names(value: Any) -> list:
    """`identity,alpaca_en_demo` (LLaMA-Factory's comma list) or a YAML list -> the names."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


# LLaMA-Factory's stages and preference losses -> our objective (None: none here)
LF_OBJECTIVES: Dict[str, Optional[str]] = {
    "sft": "objective: sft", "pt": "objective: sft with data.train_on: all (continued pre-training)",
    "dpo": "objective: dpo", "rm": "objective: reward", "ppo": "objective: grpo (online RL; there is no PPO here)",
    "simpo": "objective: dpo with objective.loss: simpo", "ipo": "objective: dpo with objective.loss: ipo",
    "kto": None,
}


def _stage(value: Any) -> str:
    objective = LF_OBJECTIVES.get(str(value))
    if objective is None:
        objective = f"no {value} objective (objectives: sft, dpo, orpo, reward, grpo)"
    return f"LLaMA-Factory's stage is the training objective; here: {objective} (zero.stage is DeepSpeed's ZeRO stage)"


def _finetuning_type(value: Any) -> str:
    if value == "lora":
        return HERE + ("model.lora.enabled: true (unset, LLaMA-Factory's LoRA is lora_target: all, lora_alpha: 2 x "
                       "lora_rank, lora_dropout: 0; ours is model.lora.target_modules: [q_proj, k_proj, v_proj, "
                       "o_proj], model.lora.alpha: 16, model.lora.dropout: 0.05: set them for the same adapter)")
    if value == "full":
        return NOT_NEEDED + "full fine-tuning is the default (model.lora.enabled: false)"
    return f"no {value} fine-tuning here: full (the default) or model.lora.enabled: true"


def _precision(name: str) -> Callable[[Any], str]:
    def rule(value: Any) -> str:
        if value is True:
            return HERE + f"precision: {name}"
        return NOT_NEEDED + "choose one precision with precision: bf16|fp16|fp32"
    return rule


def _deepspeed(value: Any) -> str:
    found = re.search(r"z(?:ero)?_?([0-3])", str(value))
    stage = f"zero: stage{found.group(1)}" if found else "zero: stage0|stage1|stage2|stage3"
    offload = " with offload: cpu_optimizer" if "offload" in str(value) else ""
    return (f"{HERE}{stage}{offload} (the DeepSpeed JSON is generated from the zero, offload and precision groups; "
            "no file to point at)")


def _dataset(value: Any) -> str:
    names = _names(value)
    return (f"LLaMA-Factory's dataset names entries of dataset_info.json; here: dataset.use: {_plain(names)} with "
            "dataset.registry: DIR/dataset_info.json (or dataset.paths: [FILE.jsonl] for files)")


def _epochs(value: Any) -> str:
    whole = int(value) if isinstance(value, (int, float)) and float(value).is_integer() else None
    if whole is None:
        return HERE + f"trainer.epochs: N (whole epochs), or trainer.max_steps: N for a part of one ({value})"
    return HERE + f"trainer.epochs: {whole} with trainer.max_steps: null (else the step budget, 400 by default, wins)"


def _lora_target(value: Any) -> str:
    if str(value) == "all":
        return (HERE + "model.lora.target_modules: [all-linear] (peft's name for every linear layer but the output "
                "one, of any model: LLaMA-Factory's `all`)")
    return HERE + f"model.lora.target_modules: {_plain(_names(value))}"


def _pref_loss(value: Any) -> str:
    if value == "orpo":
        return HERE + "objective: orpo"
    if value in ("sigmoid", "ipo", "simpo"):
        return HERE + f"objective.loss: {value}"
    return f"no {value} preference loss here (objective.loss: sigmoid, ipo, robust, simpo; objective: orpo)"


def _flash_attn(value: Any) -> str:
    impl = {"fa2": "flash_attention_2", "sdpa": "sdpa", "disabled": "eager"}.get(str(value))
    return HERE + f"model.attn_implementation: {impl}" if impl else NOT_NEEDED + "model.attn_implementation: sdpa " \
        "is the default"


def _streaming(value: Any) -> str:
    return HERE + "data: iterable (reads the files as a stream)" if value is True else NOT_NEEDED + "data: map " \
        "is the default"


def _scheduler(value: Any) -> str:
    if value in ("cosine", "linear", "constant"):
        return HERE + f"scheduler: {value}"
    if value == "cosine_with_min_lr":
        return HERE + "scheduler: cosine with scheduler.min_lr_ratio: R (lr_scheduler_kwargs' min_lr_rate)"
    return f"no {value} schedule here (scheduler: cosine, linear, constant; all with warmup)"


OUR_TEMPLATES = "template: auto (the tokenizer's own chat template), chatml, llama3, vicuna, human_assistant, plain, tokenizer"
# LLaMA-Factory's template names -> ours: the same format under another name, or (None) a model's own format, which
# template: auto reads from the model's tokenizer.
LF_TEMPLATES: Dict[str, Optional[str]] = {
    **dict.fromkeys(("qwen", "qwen3", "qwen3_nothink", "yi", "chatml_de", "dbrx", "opencoder"), "chatml"),
    "default": "human_assistant", "alpaca": "plain", "empty": "plain",
    **dict.fromkeys(("llama2", "llama2_zh", "llama4", "mistral", "mistral_small", "gemma", "gemma2", "gemma3", "phi",
                     "phi4", "phi_small", "deepseek", "deepseek3", "deepseekr1", "deepseekcoder", "glm4", "chatglm3",
                     "baichuan2", "zephyr", "cohere", "falcon", "granite3", "olmo", "intern2", "openchat", "solar",
                     "starchat", "qwen2_vl", "qwen2_audio", "llava", "minicpm_v", "pixtral", "hunyuan", "sailor"), None),
}
# LLaMA-Factory templates that are ours plus a default system prompt (its register_template default_system), put in
# every conversation without one: translated to `template.default_system` beside the template. Ours already carry
# none of them (vicuna's is FastChat's, as LF's vicuna); sailor's turns are `<|im_start|>question` / `answer`, no twin.
LF_SYSTEMS = {
    "qwen": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "opencoder": "You are OpenCoder, created by OpenCoder Team.",
    "chatml_de": "Du bist ein freundlicher und hilfsbereiter KI-Assistent.",
    "dbrx": "You are DBRX, created by Databricks. You were last updated in December 2023. You answer questions based on "
            "information available up to that point.\nYOU PROVIDE SHORT RESPONSES TO SHORT QUESTIONS OR STATEMENTS, but "
            "provide thorough responses to more complex and open-ended questions.\nYou assist with various tasks, from "
            "writing to coding (using markdown for code blocks \u2014 remember to use ``` with code, JSON, and tables).\n"
            "(You do not have real-time data access or code execution capabilities. You avoid stereotyping and provide "
            "balanced perspectives on controversial topics. You do not provide song lyrics, poems, or news articles and "
            "do not divulge details of your training data.)\nThis is your system prompt, guiding your responses. Do not "
            "reference it, just respond to the user. If you find yourself talking about this message, stop. You should "
            "be responding appropriately and usually that means not mentioning this.\nYOU DO NOT MENTION ANY OF THIS "
            "INFORMATION ABOUT YOURSELF UNLESS THE INFORMATION IS DIRECTLY PERTINENT TO THE USER'S QUERY.",
}
ALPACA_SYSTEM = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                 "request.\n\n")
# LLaMA-Factory's reasoning templates (ReasoningTemplate in its data/template.py) among those: before every answer
# without a <think> part they add an empty one, trained with the answer under enable_thinking: true (its default), an
# untrained end of the prompt under false. chatml adds none, auto renders the model's own chat template: no twin,
# a person decides (_reasoning says how).
LF_REASONING = ("qwen3", "deepseekr1")
# LLaMA-Factory's qwen templates render tool-calling rows as Qwen2.5's own chat template does (format_observation: a
# user turn around <tool_response>; format_tools: Qwen's "# Tools" block); chatml, here as in LF, does not.
LF_QWEN_TOOLS = ("qwen", "qwen3", "qwen3_nothink")
QWEN_TOOLS = ("; tool-calling rows differ: LLaMA-Factory's {name} puts a tool result (role observation/tool) in a user "
              "turn '<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>' and the tools in Qwen's "
              "'# Tools' system block, as Qwen2.5's own chat template does; template: chatml writes a tool result "
              "'<|im_start|>tool\\n...<|im_end|>' (as LLaMA-Factory's chatml) and 'Tools: [...]', so for tool data take "
              "template: auto on a Qwen model (its own chat template, in training and in the export alike)")
EMPTY_THINK = "<think>\\n\\n</think>\\n\\n"


def _reasoning(name: str, ours: Optional[str]) -> str:
    kin, nothink = ours or "the model's own format", " (LLaMA-Factory's qwen3_nothink)" if name == "qwen3" else ""
    here = f"template: {ours} adds none: it trains the answers as your data writes them{nothink}" if ours else (
        "template: auto renders the model tokenizer's own chat template as it is (dsrecipes inspect-data shows the "
        "tokens it trains)")
    return (f"LLaMA-Factory's {name} template is {kin} plus an empty "
            f"thinking block '{EMPTY_THINK}' it adds before every answer without a <think> part, trained with the "
            "answer (enable_thinking: true, its default; false puts it untrained at the end of the prompt and removes "
            f"the answers' reasoning). Here: {here}; to train that block as LLaMA-Factory does, start each answer "
            f"without a <think> part with '{EMPTY_THINK}' in your data")


def _template(value: Any) -> str:
    """LLaMA-Factory's `template: qwen` -> ours (LF_TEMPLATES), else the list of ours; qwen's tool rows: QWEN_TOOLS."""
    twin = _template_twin(str(value)) + lf_differences.eot_newline(str(value))  # its newline after <|im_end|> & co
    return twin + (QWEN_TOOLS.format(name=value) if str(value) in LF_QWEN_TOOLS else "")


def _template_twin(name: str) -> str:
    if name not in LF_TEMPLATES:
        return "templates here: " + OUR_TEMPLATES
    ours = LF_TEMPLATES[name]
    if name in LF_REASONING:
        return _reasoning(name, ours)
    auto = "template: auto (the default: the model tokenizer's own chat template, its default system prompt included)"
    if name == "sailor":
        return ("LLaMA-Factory's sailor template is not chatml: its turns are '<|im_start|>question' / "
                "'<|im_start|>answer' (chatml: user / assistant), after its default system prompt 'You are an AI "
                f"assistant named Sailor created by Sea AI Lab. ...'; no template here writes those; here: {auto}")
    if ours is None:
        return f"LLaMA-Factory's {name} template is the model's own format; here: {auto}"
    if name in LF_SYSTEMS:
        text = LF_SYSTEMS[name]
        said, here = (repr(text), repr(text)) if len(text) < 100 else (repr(text[:60] + "..."), "that text")
        return (f"LLaMA-Factory's {name} template is {ours} plus its default system prompt {said}, put in every "
                f"conversation without one (chatml alone puts none); here: template: {ours} with "
                f"template.default_system: {here}, or {auto}")
    kin = "is closest to" if name in ("default", "alpaca", "empty") else "is"
    alpaca = (f" (LLaMA-Factory's alpaca also starts every conversation without a system prompt with {ALPACA_SYSTEM!r}"
              ": template.default_system writes one)") if name == "alpaca" else ""
    return f"LLaMA-Factory's {name} template {kin} {ours}{alpaca}; here: template: {ours}, or {auto}"


def _thinking(value: Any) -> str:
    """LLaMA-Factory's reasoning templates (qwen3, deepseekr1, ...) add an empty <think></think> block to answers
    without one: trained (true, its default) or in the prompt with the answers' reasoning removed (false). Our
    templates render the answers as the data writes them and pass no enable_thinking to a model's own template."""
    where = ("our templates train the answers as your data writes them (no empty <think></think> block added), and "
             "template: auto renders the model's own chat template without an enable_thinking value")
    if value is False:
        return (f"no thinking switch here: {where}; to train answers without reasoning, remove the <think>...</think> "
                "part from the answers in your data")
    return (f"no thinking switch here: {where}; to train reasoning, keep the <think>...</think> part in the answers "
            "of your data, with template: auto (the model tokenizer's own chat template) for a reasoning model")


def _trust_remote_code(value: Any) -> str:
    if value is True:
        return ("model.trust_remote_code stays false here: a model directory that needs its own code is refused "
                "(Llama, Qwen, Mistral, ... need none with a current transformers)")
    return NOT_NEEDED + "model.trust_remote_code is false"


def _resume_from(value: Any) -> str:
    if value is None:
        return NOT_NEEDED + "a run continues from its trainer.output_dir's newest checkpoint (trainer.resume: auto)"
    return HERE + f"trainer.resume_from: {_plain(value)}"


def _switch(on: str, off: str) -> Callable[[Any], str]:
    """A true/false key: `on` (ours, said with HERE) when true, else `off` (why it is not needed)."""
    return lambda v: HERE + on if v is True else NOT_NEEDED + off


def _adam_beta(index: int) -> Callable[[Any], str]:
    def rule(value: Any) -> str:
        betas = [0.9, 0.999]
        betas[index] = value
        return HERE + f"optimizer.betas: {_plain(betas)} (both Adam betas in one list)"
    return rule


def _mix(value: Any) -> str:
    return ("no interleaving here: a source's weight (dataset.sources[i].weight, or a registry entry's weight) gives "
            "round(weight x its rows) samples per epoch, spread over the epoch, none cut short (concat: every weight 1, "
            "the default)")


def _scheduler_kwargs(value: Any) -> str:
    rate = value.get("min_lr_rate") if isinstance(value, dict) else None
    return HERE + (f"scheduler.min_lr_ratio: {rate}" if rate is not None else "scheduler.min_lr_ratio (the only one)")


def _eval_every(what: str) -> str:
    return NOT_NEEDED + f"{what} runs every trainer.eval_every steps (0: only at the end)"


# A key of another tool (Hugging Face TrainingArguments, LLaMA-Factory, axolotl) -> ours, for "did you mean" on the
# command line (hints.full_key) and in config.yaml-like files; a flat recipe file gets the whole line (RULES below).
# Keys whose value decides our spelling (`finetuning_type=lora` -> model.lora.enabled: true, `lr_scheduler_type`,
# `deepspeed`, `lora_target`) are not here: the command line gets their RULES line with the value, as a file does.
FROM_OTHER_TOOLS = {
    "learning_rate": "optimizer.lr", "num_train_epochs": "trainer.epochs", "num_epochs": "trainer.epochs",
    "per_device_train_batch_size": "trainer.micro_batch_size", "gradient_accumulation_steps": "trainer.grad_accum",
    "gradient_accumulation": "trainer.grad_accum", "logging_steps": "trainer.log_every",
    "save_steps": "trainer.save_every", "eval_steps": "trainer.eval_every", "save_total_limit": "trainer.keep_checkpoints",
    "max_grad_norm": "trainer.gradient_clipping", "resume_from_checkpoint": "trainer.resume_from",
    "model_name_or_path": "model.path", "base_model": "model.path", "lora_rank": "model.lora.r", **TRL_RENAMES,
    "bf16": "precision=bf16", "fp16": "precision=fp16", "sequence_len": "data.cutoff_len",
    "dataset_dir": "dataset.registry", "warmup_steps": "scheduler.warmup_steps",
    "warmup_ratio": "scheduler.warmup_ratio", "cutoff_len": "data.cutoff_len", "val_size": "dataset.val_size",
    "output_dir": "trainer.output_dir", "pref_beta": "objective.beta", "pref_loss": "objective.loss",
    "max_samples": "dataset.max_samples", "dataloader_num_workers": "data.num_workers",
    "lora_alpha": "model.lora.alpha", "lora_dropout": "model.lora.dropout", "simpo_gamma": "objective.simpo_gamma",
}


# key -> a dsrecipes key (the value carries over: `KEY: VALUE`) or a rule (value -> the line)
RULES: Dict[str, Rule] = {
    # method
    "stage": _stage, "finetuning_type": _finetuning_type, "lora_rank": "model.lora.r", "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout", "lora_target": _lora_target, "pref_beta": "objective.beta",
    "pref_loss": _pref_loss, "simpo_gamma": "objective.simpo_gamma", "dpo_label_smoothing": "objective.label_smoothing",
    "use_dora": lambda v: "no DoRA here: model.lora.enabled: true trains plain LoRA",
    "disable_gradient_checkpointing": lambda v: NOT_NEEDED + "model.gradient_checkpointing: false is the default "
    "here" if v is True else HERE + "model.gradient_checkpointing: true (on in LLaMA-Factory by default, off here)",
    "pref_ftx": lambda v: "no SFT term in objective=dpo here; objective: orpo adds the chosen answers' NLL",
    "do_train": lambda v: NOT_NEEDED + "dsrecipes trains when started (dsrecipes FILE.yaml)",
    "do_eval": lambda v: _eval_every("evaluation"), "do_predict": lambda v: NOT_NEEDED + "dsrecipes prompt-eval RUN",
    "plot_loss": lambda v: NOT_NEEDED + "every run writes loss.png",
    # model
    "model_name_or_path": "model.path", "trust_remote_code": _trust_remote_code, "flash_attn": _flash_attn,
    "quantization_bit": lambda v: "no quantized (QLoRA) training here: model.lora.enabled: true on bf16 weights",
    "adapter_name_or_path": lambda v: "to start from a trained LoRA run, point model.path at its export directory",
    # dataset
    "dataset": _dataset, "dataset_dir": lambda v: HERE + f"dataset.registry: {v}/dataset_info.json",
    "template": _template, "cutoff_len": "data.cutoff_len", "max_samples": "dataset.max_samples",
    "val_size": "dataset.val_size", "preprocessing_num_workers": "data.preprocess_workers",
    "packing": _switch(lf_differences.PACKING, "data.packing: false is the default"), "streaming": _streaming,
    "overwrite_cache": lambda v: NOT_NEEDED + "prepared data is cached by content; a change prepares it again",
    "eval_dataset": lambda v: "dataset.val_paths: [FILE.jsonl] (validation files)",
    "train_on_prompt": _switch("data.train_on: all (the prompt turns too)", "data.train_on: assistant (every "
                               "assistant turn) is the default"),
    "mask_history": _switch(lf_differences.MASK_HISTORY, "data.train_on: assistant (every assistant turn) is the "
                            "default"),
    "neat_packing": _switch("data.packing: true (packed samples already attend only within themselves: position ids "
                            "restart per sample)", "data.packing: false is the default"),
    "buffer_size": "data.shuffle_buffer", "mix_strategy": _mix, "interleave_probs": _mix,
    "default_system": "template.default_system", "new_special_tokens": lambda v: "no new special tokens here: the "
    "vocabulary is the tokenizer's (a template's special tokens must already be single tokens of it)",
    "resize_vocab": lambda v: NOT_NEEDED + "the vocabulary is the tokenizer's and is not resized",
    "tokenized_path": lambda v: NOT_NEEDED + "prepared data is cached under data.cache_dir",
    "enable_thinking": _thinking,
    # output
    "output_dir": "trainer.output_dir", "logging_steps": "trainer.log_every", "save_steps": "trainer.save_every",
    "save_total_limit": "trainer.keep_checkpoints", "report_to": report_to,
    "overwrite_output_dir": lambda v: NOT_NEEDED + "an existing trainer.output_dir resumes; a run is never "
    "overwritten",
    "save_only_model": lambda v: NOT_NEEDED + "checkpoints keep what resuming needs; the export is the model alone",
    # train
    "per_device_train_batch_size": "trainer.micro_batch_size",
    "gradient_accumulation_steps": lambda v: HERE + f"trainer.grad_accum: {_plain(v)}" + lf_differences.grad_accum(v),
    "learning_rate": "optimizer.lr", "num_train_epochs": _epochs, "max_steps": "trainer.max_steps",
    "lr_scheduler_type": _scheduler, "warmup_ratio": "scheduler.warmup_ratio", "warmup_steps": "scheduler.warmup_steps",
    "weight_decay": "optimizer.weight_decay", "max_grad_norm": "trainer.gradient_clipping", "seed": "trainer.seed",
    "bf16": _precision("bf16"), "fp16": _precision("fp16"), "deepspeed": _deepspeed,
    "gradient_checkpointing": "model.gradient_checkpointing", "resume_from_checkpoint": _resume_from,
    "dataloader_num_workers": "data.num_workers",
    "ddp_timeout": lambda v: NOT_NEEDED + "a rank silent for launcher.peer_timeout_s seconds ends the run",
    "optim": lambda v: "optimizer: adamw|adam|lion|sgd",
    "adam_beta1": _adam_beta(0), "adam_beta2": _adam_beta(1), "adam_epsilon": "optimizer.eps",
    "lr_scheduler_kwargs": _scheduler_kwargs, "pure_bf16": _precision("bf16"),
    "run_name": lambda v: NOT_NEEDED + "trainer.output_dir names the run; trainer.experiment is the MLflow "
    "experiment and the W&B project",
    "logging_dir": lambda v: NOT_NEEDED + "TensorBoard events go to RUN/tb, logs to RUN/logs",
    # eval
    "per_device_eval_batch_size": lambda v: NOT_NEEDED + "evaluation uses trainer.micro_batch_size",
    "eval_strategy": eval_strategy, "evaluation_strategy": eval_strategy,
    "eval_steps": "trainer.eval_every", "save_strategy": lambda v: NOT_NEEDED + "a checkpoint every "
    "trainer.save_every steps", "load_best_model_at_end": "trainer.save_best.enabled",
    "metric_for_best_model": "trainer.save_best.metric", "eval_on_start": "trainer.eval_at_start",
    "early_stopping_steps": "trainer.early_stopping.patience",  # evaluations without improvement, as LF's callback
    "include_num_input_tokens_seen": lambda v: NOT_NEEDED + "metrics.jsonl logs tokens_per_s and samples_seen at "
    "every logged step",
    "use_fast_tokenizer": lambda v: NOT_NEEDED + "the tokenizer loads as transformers' AutoTokenizer loads it (the "
    "fast one where the directory has tokenizer.json)",
    "dataloader_pin_memory": lambda v: "no such setting here: batches of token ids go to the device at each step "
    "(offload.pin_memory is DeepSpeed's, for offloaded states)",
    # export (llamafactory-cli export)
    "export_dir": lambda v: f"a run exports itself to RUN/export; another copy: dsrecipes export RUN --out {v}",
}
TRL_ONLY = {**TRL_RENAMES, **TRL_RULES}.keys() - RULES.keys()  # TRL's own keys (config/trl_keys.py): "TRL's key"
RULES.update({key: rule for key, rule in {**TRL_RENAMES, **TRL_RULES}.items() if key in TRL_ONLY})
RULES.update({key: rule for key, rule in DSCHAT_RULES.items() if key not in RULES})  # config/dschat_keys.py


def foreign_key(key: str, value: Any) -> Optional[str]:
    """The line for `key: value` from another tool (module docstring), None for a key this table does not know."""
    rule = RULES.get(key)
    if rule is None:
        return None
    line = (TRL if key in TRL_ONLY else HERE) + f"{rule}: {_plain(value)}" if isinstance(rule, str) else rule(value)
    return relabel(key, line, HERE)  # transformers' keys are a TRL user's too, not LLaMA-Factory's alone


def foreign_option(group: str, value: Any, close: bool) -> Optional[str]:
    """The line for a group option that is another tool's name (`template=qwen`, `dataset=alpaca_en_demo`: entries of
    a dataset_info.json), None for anything else. `close`: the option is a near spelling of one of ours, which then
    wins, unless it is LLaMA-Factory's own template name (llama2 is not a typo of llama3)."""
    if group == "template" and str(value) in LF_TEMPLATES:
        return _template(value)
    if group == "objective" and str(value) in LF_OBJECTIVES:  # ppo is not a typo of dpo
        ours = LF_OBJECTIVES[str(value)] or f"no {value} objective (objectives: sft, dpo, orpo, reward, grpo)"
        return f"LLaMA-Factory's {value}; here: {ours}"
    if group in ("template", "dataset") and not close:
        return foreign_key(group, value)
    return None
