"""Typed schema of every config group.

One dataclass per group, one Enum per closed choice. Defaults live here and only here: code below the entry point
receives a `TrainConfig` and never looks keys up with a fallback. Field names are the names users type
(`trainer.micro_batch_size`, `data.cutoff_len`, ...); keep them in sync with README's table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from dsrecipes.core.choices import AttnImpl as AttnImpl
from dsrecipes.core.choices import BadRows as BadRows
from dsrecipes.core.choices import DataKind as DataKind  # re-exported: the schema's field types, imported from here
from dsrecipes.core.choices import DatasetFormat as DatasetFormat
from dsrecipes.core.choices import Device as Device
from dsrecipes.core.choices import DpoLoss as DpoLoss
from dsrecipes.core.choices import LauncherKind as LauncherKind
from dsrecipes.core.choices import LossAverage as LossAverage
from dsrecipes.core.choices import NanPolicy as NanPolicy
from dsrecipes.core.choices import ObjectiveKind as ObjectiveKind
from dsrecipes.core.choices import OffloadDevice as OffloadDevice
from dsrecipes.core.choices import OptimizerKind as OptimizerKind
from dsrecipes.core.choices import PairsAs as PairsAs
from dsrecipes.core.choices import Precision as Precision
from dsrecipes.core.choices import ReferenceMode as ReferenceMode
from dsrecipes.core.choices import ReportTo as ReportTo
from dsrecipes.core.choices import ResumeMode as ResumeMode
from dsrecipes.core.choices import RowKind as RowKind
from dsrecipes.core.choices import SchedulerKind as SchedulerKind
from dsrecipes.core.choices import SelectMetric as SelectMetric
from dsrecipes.core.choices import SelectMode as SelectMode
from dsrecipes.core.choices import ShardBalance as ShardBalance
from dsrecipes.core.choices import TemplateKind as TemplateKind
from dsrecipes.core.choices import TrainOn as TrainOn
from dsrecipes.core.paths import SAMPLE_DATA_DIR

DEFAULT_MAX_ROW_BYTES = 16 * 1024 * 1024  # dataset.max_row_bytes (also the default of the row readers' `limit`)
DEFAULT_READ_AHEAD_BYTES = 64 * 1024 * 1024  # data.read_ahead_bytes (also BlockSource's default)
DEFAULT_SPAN_BYTES = 8 * 1024 * 1024  # data.span_bytes (also BlockSource's default)


@dataclass
class DataConfig:
    """How prepared samples reach the model (`data=map|iterable|presharded`)."""

    kind: DataKind = DataKind.map
    num_workers: int = 0  # DataLoader workers per rank
    shuffle: bool = True
    shuffle_buffer: int = 1024  # iterable: window of each reader's local shuffle, in samples (0 = block order only)
    cutoff_len: int = 512  # max tokens per row (sample, or packed row)
    packing: bool = False
    train_on: TrainOn = TrainOn.assistant
    preprocess_workers: int = 1  # processes for tokenization (map / presharded preparation)
    cache_dir: Optional[str] = None  # tokenization cache; None = ~/.cache/dsrecipes
    num_samples: Optional[int] = None  # iterable only: plan epochs of this many samples (default: the index's count)
    shard_dir: Optional[str] = None  # presharded only: directory written by `dsrecipes shard`
    prescan: bool = True  # iterable only: read the stream once before launch to apply the bad-row policy (false:
    # rows checked only as training reads them: no quarantine, max_bad_fraction or reference count; README)
    block_bytes: Optional[int] = None  # iterable: bytes per read block (null: stream bytes / 65536, in a store 4096)
    prefetch_factor: int = 2
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES  # iterable, objects in a store: bytes each reader holds ahead
    span_bytes: int = DEFAULT_SPAN_BYTES  # iterable, objects in a store: one ranged GET covers adjacent blocks up to this
    read_deadline_s: float = 120.0  # objects in a store: one read fails after this long, all its retries included
    chunk_bytes: Optional[int] = None  # iterable: the epoch order keeps this many bytes of adjacent blocks together
    # (null: objects in a store: stream bytes / 128 up to a power of two, within one block and min(1 MiB, span_bytes);
    # local files: one block)


@dataclass
class ColumnsConfig:
    """Where a source keeps each field (LLaMA-Factory `columns`/`tags` in one place)."""

    messages: str = "conversations"  # list of turns (sharegpt / openai)
    role: str = "from"  # key of the role inside a turn
    content: str = "value"  # key of the text inside a turn
    system: str = "system"  # optional top-level system prompt
    tools: str = "tools"  # optional top-level tools text
    id: str = "id"  # optional stable sample id
    instruction: str = "instruction"  # alpaca
    input: str = "input"  # alpaca
    output: str = "output"  # alpaca
    history: str = "history"  # alpaca: optional list of [prompt, response] pairs before the instruction
    prompt: str = "prompt"  # preference rows, openai format (TRL): the prompt's messages
    chosen: str = "chosen"  # preference rows: the preferred answer (a message, or a list of one message)
    rejected: str = "rejected"  # preference rows: the dispreferred answer


@dataclass
class ShareOfSource:
    """The share of `dataset.split` a run reads, set on each source by registry.resolve_sources (not by users)."""
    shares: Dict[str, int] = field(default_factory=dict)
    take: str = ""
    pinned: Optional[str] = None  # every row of this source belongs to this share


@dataclass
class SplitConfig:
    """One dataset split into named step shares by a stable row hash (DeepSpeed-Chat's --data_split 2,4,4)."""
    shares: Dict[str, int] = field(default_factory=dict)  # share name -> weight; empty: no split
    take: Optional[str] = None  # the share this run reads
    pin: Dict[str, str] = field(default_factory=dict)  # source name -> share holding all its rows (SFT-only data)


@dataclass
class SourceConfig:
    """One dataset in a mix (an entry of `dataset.sources` or of a registry file)."""

    name: str = ""
    paths: List[str] = field(default_factory=list)
    format: DatasetFormat = DatasetFormat.sharegpt
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    roles: Dict[str, str] = field(default_factory=dict)  # extra role aliases: raw name -> canonical role
    max_samples: Optional[int] = None
    weight: float = 1.0
    ranking: Optional[bool] = None  # preference rows (LLaMA-Factory `ranking`); None: what objective.kind reads
    share: Optional[ShareOfSource] = None  # set from dataset.split when sources are resolved
    pairs_as: Optional[PairsAs] = None  # null: dataset.pairs_as (set from it when sources are resolved)


@dataclass
class DatasetConfig:
    """Which files, in which format (`dataset=sample|sharegpt_files|...`)."""

    name: str = "sample"
    paths: List[str] = field(default_factory=lambda: [str(SAMPLE_DATA_DIR / "train.jsonl")])  # files or globs
    format: DatasetFormat = DatasetFormat.sharegpt
    columns: ColumnsConfig = field(default_factory=ColumnsConfig)
    roles: Dict[str, str] = field(default_factory=dict)
    max_samples: Optional[int] = None
    sources: List[SourceConfig] = field(default_factory=list)  # extra sources mixed with `paths`
    registry: Optional[str] = None  # dataset_info.json (LLaMA-Factory) or YAML registry
    use: List[str] = field(default_factory=list)  # registry entries to mix in
    mix_sample: bool = False  # with dataset.use/sources: also train on the bundled sample (else they replace it)
    val_size: float = 64  # < 1: fraction, >= 1: number of samples
    val_paths: List[str] = field(default_factory=list)  # validation files, every strategy (then val_size is unused)
    bad_rows: BadRows = BadRows.error
    max_bad_fraction: float = 0.05
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES  # a longer row is a bad row (too_large), skipped without being held
    split: SplitConfig = field(default_factory=SplitConfig)  # shares across an experiment's steps (data_split)
    pairs_as: PairsAs = PairsAs.refuse  # sft on a pair row: refuse | chosen (its prompt + chosen, DS-Chat step 1)


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    only_optimize_lora: bool = True
    finetune_lr: float = 2e-4  # this model's LoRA learning rate: x objective.lr_scale when optimizer.lr is null


@dataclass
class TinyModelConfig:
    """The embedded default model: a seeded random Llama-style config built in memory."""

    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True  # share input and output embeddings (most of a tiny model is embeddings)
    seed: int = 1234  # init seed, independent of trainer.seed: the same start model whatever the data order
    finetune_lr: float = 3e-3  # its learning rate (full or LoRA) when optimizer.lr is null: random init learns fast


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: Optional[str] = None  # local HF directory or hub id Org/Name; None = embedded tiny model + bundled tokenizer
    tokenizer_path: Optional[str] = None  # defaults to `path`
    revision: Optional[str] = None  # hub id only: branch, tag or commit (the launch records the commit it got)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    attn_implementation: AttnImpl = AttnImpl.sdpa
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    finetune_lr: float = 2e-5  # full fine-tune rate of a model at `path`: x objective.lr_scale when optimizer.lr is null
    num_params: Optional[int] = None  # for `estimate` when the weights are not on this machine
    arch: Dict[str, Any] = field(default_factory=dict)  # HF config fields (model_type, hidden_size, ...) for `estimate`
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class TemplateConfig:
    name: TemplateKind = TemplateKind.auto
    separator: str = "\n\n"  # plain template: between turns
    default_system: Optional[str] = None  # used when a sample has no system prompt
    train_eot_newline: bool = False  # train the text after the end-of-turn token (chatml "\n") as TRL does (README)


@dataclass
class ZeroConfig:
    stage: int = 0
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = True


@dataclass
class OffloadConfig:
    optimizer: OffloadDevice = OffloadDevice.none
    param: OffloadDevice = OffloadDevice.none
    nvme_path: Optional[str] = None
    pin_memory: bool = True

    @property
    def label(self) -> str:
        """What is offloaded where, e.g. `none`, `optimizer=cpu`, `optimizer=cpu,param=cpu`."""
        parts = [f"{k}={v.value}" for k, v in (("optimizer", self.optimizer), ("param", self.param))
                 if v is not OffloadDevice.none]
        return ",".join(parts) or "none"


@dataclass
class PrecisionConfig:
    dtype: Precision = Precision.fp32
    loss_scale: float = 0.0  # fp16: 0 = dynamic
    initial_scale_power: int = 16  # fp16 dynamic scaler starts at 2**power
    loss_scale_window: int = 1000


@dataclass
class OptimizerConfig:
    name: OptimizerKind = OptimizerKind.adamw
    lr: Optional[float] = None  # null: the model's own (config/defaults.py: learning_rate)
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.0  # sgd only
    torch_adam: bool = True  # adam/adamw: torch's implementation (no JIT build); offloaded: DeepSpeedCPUAdam always


@dataclass
class SchedulerConfig:
    """The LR schedule (closed form in dsrecipes/rank/schedule.py): linear warmup from lr / warmup_steps, then the decay."""

    name: SchedulerKind = SchedulerKind.cosine
    warmup_steps: int = 10  # 0: the first step at the peak; longer than the run: clamped to it (with a note)
    warmup_ratio: Optional[float] = None  # set: warm up over ceil(ratio x the run's steps) instead of warmup_steps
    min_lr_ratio: float = 0.0  # linear/cosine: the floor the decay approaches, as a fraction of optimizer.lr


@dataclass
class SaveBestConfig:
    """Keep (out of retention) and export the checkpoint of the best evaluation after step 0 (`<run>/export_best`)."""

    enabled: bool = False
    metric: SelectMetric = SelectMetric.eval_loss  # also what trainer.early_stopping watches
    mode: Optional[SelectMode] = None  # null: min for eval_loss/eval_ppl, max for the others


@dataclass
class EarlyStoppingConfig:
    """End the run (cleanly: checkpoint, export) after `patience` evaluations in a row without an improvement of
    `trainer.save_best.metric` by more than `min_delta` over the best after step 0."""

    patience: int = 0  # 0 = off
    min_delta: float = 0.0


@dataclass
class TrainerConfig:
    micro_batch_size: Any = 8  # an int >= 1, or "auto": the largest that fits one GPU (run/micro_batch.py)
    grad_accum: int = 1
    max_steps: Optional[int] = 400  # optimizer steps; null: train `epochs` passes over the data
    epochs: int = 1
    save_every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    eval_every: int = 100  # 0 = only at the end (when there is a validation split)
    eval_samples: Optional[int] = None  # validation samples per evaluation over all ranks (the first N); null = all
    eval_batches: Optional[int] = None  # replaced by eval_samples (refused when set: it depended on the world size)
    eval_at_start: bool = True  # evaluate the starting weights (step 0) before the first step
    save_best: SaveBestConfig = field(default_factory=SaveBestConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    prompt_eval_every: int = 0  # steps between prompt-evals of held-out prompts during training (data=map); 0 = off
    prompt_eval_samples: int = 8  # the first N validation samples, answered greedily and scored like prompt-eval
    prompt_eval_max_new_tokens: int = 64
    log_every: int = 10
    keep_checkpoints: int = 2
    resume: ResumeMode = ResumeMode.auto
    resume_from: Optional[str] = None  # a checkpoint (checkpoints/step_<N>), or a run / checkpoints dir holding one
    seed: int = 42
    output_dir: Optional[str] = None  # run directory; None = Hydra's run directory
    record_samples: bool = False
    gradient_clipping: float = 1.0
    export: bool = True  # write a Hugging Face model directory at the end
    export_merged_lora: bool = True  # LoRA runs: merged model (true) or adapter only (false)
    device: Device = Device.auto
    nan_policy: NanPolicy = NanPolicy.stop
    nan_max_skips: int = 3  # nan_policy=skip: this many non-finite steps in a row fail the run
    stop_grace_s: float = 60.0  # after SIGTERM/SIGINT: time for the ranks to reach a step boundary and checkpoint
    report_to: List[ReportTo] = field(default_factory=lambda: [ReportTo.tensorboard])  # []: metrics.jsonl only
    experiment: str = "dsrecipes"  # MLflow experiment / W&B project
    tracking_uri: Optional[str] = None  # MLflow (file:/path, sqlite:///db, http://host); None: MLFLOW_TRACKING_URI
    ce_chunk_tokens: int = 0  # 0: loss on the full logits; N: head + loss N tokens at a time (objectives/chunked_ce)


@dataclass
class RewardConfig:
    """One weighted reward of `objective=grpo` (`objective.rewards`; objectives/rewards.py)."""
    name: str = "exact_match"  # exact_match|number_equal|regex|length, or an installed `dsrecipes.rewards` entry
    weight: float = 1.0
    pattern: Optional[str] = None  # regex: the completion must match it (re.search) for reward 1
    min_chars: int = 0  # length: reward 1 when min_chars <= len(completion) <= max_chars
    max_chars: Optional[int] = None


@dataclass
class ObjectiveConfig:
    """What the training step optimises (`objective=sft|dpo`): collate, loss and metrics, evaluation
    (dsrecipes/objectives/)."""

    kind: ObjectiveKind = ObjectiveKind.sft
    rows: RowKind = RowKind.conversation  # declared by the objective's option file, not a user setting
    lr_scale: float = 1.0  # x the model's finetune_lr when optimizer.lr is unset (config/defaults.py); in (0, 1]
    beta: float = 0.1  # dpo: strength of the KL anchor to the reference model; orpo: lambda, the odds-ratio weight
    loss: DpoLoss = DpoLoss.sigmoid  # dpo
    label_smoothing: float = 0.0  # dpo: assumed fraction of flipped preference labels (sigmoid, robust)
    reference: ReferenceMode = ReferenceMode.precomputed  # dpo (not with loss=simpo, which has no reference)
    simpo_gamma: float = 0.5  # dpo, loss=simpo: target reward margin (TRL's name and default)
    num_generations: int = 4  # grpo: completions sampled per prompt (a group)
    max_completion_length: int = 64  # grpo: new tokens per completion; prompts must fit data.cutoff_len - this
    temperature: float = 1.0  # grpo: sampling temperature (also divides the logits of the loss, as TRL)
    epsilon: float = 0.2  # grpo: clip range of the importance ratio (TRL's epsilon)
    rewards: List[RewardConfig] = field(default_factory=list)  # grpo: built-in / installed reward checks
    reward_model: Optional[str] = None  # grpo: a sequence-classification model directory (objective=reward export)
    reward_model_weight: float = 1.0  # grpo: the reward model's weight in the sum
    center_rewards_coefficient: Optional[float] = None  # reward: weight of mean((r_chosen + r_rejected)^2) (TRL's)
    loss_average: LossAverage = LossAverage.tokens  # sft, grpo: each trained token of a step weighs the same (train.py)


@dataclass
class LauncherConfig:
    kind: LauncherKind = LauncherKind.local
    num_gpus: Optional[int] = None  # processes per node; None = all visible devices (1 on CPU)
    num_nodes: int = 1
    hostfile: Optional[str] = None
    include: Optional[str] = None
    exclude: Optional[str] = None
    master_addr: str = "127.0.0.1"
    master_port: Optional[int] = None  # None: a free port on one node, 29500 (DeepSpeed's default) on several
    node_rank: int = 0
    rdzv_endpoint: Optional[str] = None  # torchrun: host:port
    env: Dict[str, str] = field(default_factory=dict)  # documented tuning variables only (boundary/rank_env.py)
    extra_args: List[str] = field(default_factory=list)  # allowed launcher options only (boundary/launcher_args.py)
    # A rank silent this long (its node died or was cut off) ends the run on every node (core/heartbeat.py); 0: off,
    peer_timeout_s: int = 30  # with the stall watchdog (a dead node then waits for the process-group timeout)
    stall_warn_s: int = 120  # no step progress this long: a line naming the rank furthest behind, its phase; 0: off
    stall_timeout_s: int = 1800  # (the process-group timeout) then the run ends naming it (core/stall.py); 0: never
    rendezvous_timeout_s: int = 300  # all ranks meet within this, or the run ends naming who not (core/rendezvous.py)
    slurm_partition: Optional[str] = None
    slurm_time_min: int = 60
    slurm_account: Optional[str] = None
    slurm_sbatch_args: List[str] = field(default_factory=list)  # allowed `#SBATCH` directives, e.g. ["--qos=high"]
    slurm_modules: List[str] = field(default_factory=list)  # `module load NAME` before srun, e.g. ["cuda/12.1"]
    slurm_venv: Optional[str] = None  # absolute path of a virtual environment to activate before srun
    slurm_conda_env: Optional[str] = None  # or the name of a conda environment to activate
    dry_run: bool = False


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    template: TemplateConfig = field(default_factory=TemplateConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


# Keys that existed once and were removed on purpose: a config still setting one gets this message (config/hints.py).
RETIRED_KEYS: Dict[str, str] = {
    "launcher.slurm_setup": "free shell text in the batch script is no longer a config field; use "
    "launcher.slurm_modules=[cuda/12.1,...] (module load), launcher.slurm_venv=/abs/venv or "
    "launcher.slurm_conda_env=NAME (activation) and launcher.slurm_sbatch_args=['--qos=high'] (#SBATCH directives)",
}


# Group name -> schema, used by the ConfigStore registration and by `dsrecipes ls`.
GROUP_SCHEMAS: Dict[str, Any] = {
    "data": DataConfig, "dataset": DatasetConfig, "model": ModelConfig, "template": TemplateConfig, "zero": ZeroConfig,
    "offload": OffloadConfig, "precision": PrecisionConfig, "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig, "trainer": TrainerConfig, "objective": ObjectiveConfig, "launcher": LauncherConfig,
}
