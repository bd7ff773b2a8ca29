"""The closed choices of the config: one `str` Enum per choice a user names (`data=iterable`, `zero.stage`, ...).

The dataclasses in `core/schema.py` use them as field types; each Enum has one builder table where it is dispatched on
(tests/test_strategy_table.py and friends check the tables are complete).
"""

from __future__ import annotations

from enum import Enum

# model.lora.target_modules: [all-linear] is peft's name for every linear layer but the output one (LLaMA-Factory's
# lora_target: all); a list of module names otherwise.
ALL_LINEAR = "all-linear"


class DataKind(str, Enum):
    map = "map"
    iterable = "iterable"
    presharded = "presharded"


class DatasetFormat(str, Enum):
    sharegpt = "sharegpt"
    openai = "openai"
    alpaca = "alpaca"


class BadRows(str, Enum):
    error = "error"
    skip = "skip"


class TrainOn(str, Enum):
    """Which turns carry labels. Everything else is -100."""

    assistant = "assistant"  # every assistant and tool-call turn (+ its end-of-turn token)
    last_assistant = "last_assistant"  # only the final assistant turn
    all = "all"  # prompt too (system/user/observation turns)


class TemplateKind(str, Enum):
    auto = "auto"  # tokenizer's own when model.path's tokenizer has one, else chatml/plain (data/render/template_choice.py)
    tokenizer = "tokenizer"  # the tokenizer's own chat_template
    chatml = "chatml"
    llama3 = "llama3"
    vicuna = "vicuna"
    plain = "plain"
    human_assistant = "human_assistant"


class AttnImpl(str, Enum):
    sdpa = "sdpa"
    eager = "eager"
    flash_attention_2 = "flash_attention_2"


class OffloadDevice(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class OptimizerKind(str, Enum):
    adamw = "adamw"
    adam = "adam"
    lion = "lion"
    sgd = "sgd"


class SchedulerKind(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class LauncherKind(str, Enum):
    local = "local"
    deepspeed = "deepspeed"
    deepspeed_multinode = "deepspeed_multinode"
    torchrun = "torchrun"
    mpirun = "mpirun"
    slurm = "slurm"


class ShardBalance(str, Enum):
    samples = "samples"
    tokens = "tokens"


class Device(str, Enum):
    auto = "auto"  # CUDA when available, else CPU
    cpu = "cpu"
    cuda = "cuda"


class NanPolicy(str, Enum):
    """What a step with a non-finite loss (NaN/Inf on any rank) does."""

    stop = "stop"  # the run fails at that step: no checkpoint, no export of the weights it would produce
    skip = "skip"  # the step's update is dropped and counted; trainer.nan_max_skips in a row end the run


class ReportTo(str, Enum):
    """Experiment trackers (`trainer.report_to=[tensorboard,mlflow]`); metrics.jsonl and loss.png are always written."""

    tensorboard = "tensorboard"  # <run>/tb/
    mlflow = "mlflow"  # pip install 'dsrecipes[mlflow]'; trainer.tracking_uri
    wandb = "wandb"  # pip install 'dsrecipes[wandb]'; WANDB_MODE=offline needs no account


class SelectMetric(str, Enum):
    """What `trainer.save_best` and `trainer.early_stopping` judge an evaluation by (metrics.jsonl keys)."""

    eval_loss = "eval_loss"  # token-weighted mean validation cross-entropy (lower is better)
    eval_ppl = "eval_ppl"  # exp(eval_loss) (lower is better)
    eval_accuracy = "eval_accuracy"  # share of validation tokens predicted exactly (higher is better)
    prompt_exact_match = "prompt_exact_match"  # trainer.prompt_eval_every: greedy answer == reference (higher)
    prompt_similarity = "prompt_similarity"  # mean character similarity to the reference (higher)
    prompt_ended = "prompt_ended"  # share of answers that stopped at the end-of-turn token (higher)


class SelectMode(str, Enum):
    min = "min"  # lower is better
    max = "max"  # higher is better


class ObjectiveKind(str, Enum):
    sft = "sft"  # next-token cross-entropy on the trained spans of conversations
    dpo = "dpo"  # Direct Preference Optimization on (prompt, chosen, rejected) pairs
    orpo = "orpo"  # Odds Ratio Preference Optimization: SFT on chosen + odds-ratio term, no reference model
    grpo = "grpo"  # Group Relative Policy Optimization: online RL on prompts, completions sampled and rewarded
    reward = "reward"  # Bradley-Terry reward model on pairs: a scalar head scores chosen above rejected


class RowKind(str, Enum):
    """The kind of row an objective trains on, declared by its option file (conf/objective/<kind>.yaml `rows`) and
    its module (`row_kind`); the data layer reads, checks, scans, prepares and shards rows by it alone."""

    conversation = "conversation"  # a conversation with trained spans
    pair = "pair"  # a prompt with a chosen and a rejected answer (one sample)
    prompt = "prompt"  # a prompt alone (ending with a user turn), optionally with a reference answer (one sample)


class DpoLoss(str, Enum):
    sigmoid = "sigmoid"  # DPO (with objective.label_smoothing > 0: conservative DPO, cDPO)
    ipo = "ipo"  # IPO, on log-ratios averaged per answer token (as TRL)
    robust = "robust"  # robust DPO (rDPO) for noisy labels: needs objective.label_smoothing in [0, 0.5)
    simpo = "simpo"  # SimPO: no reference model; per-token average log-probs and a target margin (simpo_gamma)


class LossAverage(str, Enum):
    """How objective=sft and grpo average an optimizer step's loss over its micro-batches and ranks (rank/train.py)."""

    tokens = "tokens"  # over every trained token of the step, all micro-batches and ranks (transformers' Trainer)
    micro_batches = "micro_batches"  # the mean of the micro-batch means (DeepSpeed's plain averaging)


class ReferenceMode(str, Enum):
    precomputed = "precomputed"  # reference log-probs computed once before training, cached with the prepared data
    live = "live"  # a frozen reference model next to the trained one (LoRA: the base with adapters disabled)


class PairsAs(str, Enum):
    """How a conversation reader (objective=sft) takes a preference pair row (`dataset.pairs_as`)."""
    refuse = "refuse"  # a bad row (preference_row / no_assistant_turn): pairs are for dpo and reward
    chosen = "chosen"  # its prompt turns + the chosen answer, as DeepSpeed-Chat's step 1 trains on the pairs file


class ResumeMode(str, Enum):
    auto = "auto"  # continue from trainer.resume_from, else from the run directory's newest complete checkpoint
    never = "never"  # start from step 0
