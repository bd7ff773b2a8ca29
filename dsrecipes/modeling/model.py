"""The model: the embedded tiny Llama or a local Hugging Face directory; dtype, checkpointing, LoRA (the
tokenizer: core/tokenizer.py).

The loss lives with the objective (dsrecipes/objectives/).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from dsrecipes.core.choices import ALL_LINEAR
from dsrecipes.core.console import keep_in_log
from dsrecipes.core.errors import UserError, no_custom_code
from dsrecipes.core.schema import ObjectiveKind, Precision, TrainConfig
from dsrecipes.core.tokenizer import load_tokenizer, quantization_problems, tokenizer_dir  # noqa: F401 (the model's tokenizer, re-exported)

TORCH_DTYPES = {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}

# transformers decides "is ZeRO-3 on?" through a weak reference to this object, so it must outlive the model load.
_hf_zero3_config: Any = None


def import_modeling() -> None:
    """transformers' modeling code, imported once per process without scipy.

    It imports scipy.optimize for its object-detection losses whenever scipy is installed
    (transformers/loss/loss_for_object_detection.py: `if is_scipy_available(): from scipy.optimize import
    linear_sum_assignment`): 0.8-1.3 s of CPU in every rank, for losses a causal LM never computes (measured on the
    2-core test machine: importing transformers.modeling_utils and LlamaForCausalLM after torch, 5.5 s with, 4.7 s
    without). So the first import happens with scipy hidden (transformers then skips that import), and right after
    it scipy imports normally again and transformers' cached "is scipy available?" answers truthfully.
    """
    if "transformers.modeling_utils" in sys.modules or "scipy" in sys.modules:
        return  # imported already (or scipy is, so there is nothing to save): the caller's import does the rest
    from transformers.utils.import_utils import is_scipy_available

    forget = getattr(is_scipy_available, "cache_clear", lambda: None)  # an lru_cache in transformers 5.x
    sys.modules["scipy"] = None  # `import scipy` raises ImportError and find_spec finds nothing while this is set
    forget()  # an answer cached before (True) would make transformers import scipy.optimize anyway
    try:
        importlib.import_module("transformers.modeling_utils")
    finally:
        sys.modules.pop("scipy", None)  # nothing can have imported the real scipy while the entry was None
        forget()  # and the hidden answer (False) must not outlive the import


def scalar_head(cfg: TrainConfig) -> bool:
    """objective=reward trains a sequence-classification model with one label (a scalar score read at the last
    non-pad token, `config.pad_token_id`) instead of a causal LM; LoRA then trains the new head whole."""
    return cfg.objective.kind is ObjectiveKind.reward


def build_model(cfg: TrainConfig, tokenizer, ds_config: Optional[Dict[str, Any]] = None) -> torch.nn.Module:
    """The model to train: weights in `precision.dtype`, gradient checkpointing and LoRA as configured.

    `ds_config` (the run's DeepSpeed dict) lets a ZeRO-3 run load a local model already partitioned across ranks
    (transformers' zero.Init integration) instead of materialising it whole on every rank first.
    """
    dtype = TORCH_DTYPES[cfg.precision.dtype]
    if cfg.model.path is None:
        model = build_tiny_model(cfg, tokenizer).to(dtype)
    else:
        model = load_pretrained(cfg, dtype, ds_config, tokenizer)
    model.config.use_cache = False
    if cfg.model.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.model.lora.enabled:
        model = add_lora(cfg, model)
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    # Non-reentrant checkpointing needs no `enable_input_require_grads` hack for LoRA's frozen embeddings.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_tiny_model(cfg: TrainConfig, tokenizer) -> torch.nn.Module:
    """A Llama-style causal LM sized by `model.tiny`, randomly initialised from `model.tiny.seed`.

    The init is seeded on its own (a forked RNG) so the start model is the same whatever `trainer.seed` is, and
    building it does not consume the training RNG.
    """
    import_modeling()
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = cfg.model.tiny
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=cfg.model.attn_implementation.value,
        use_cache=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tiny.seed)
        if scalar_head(cfg):
            from transformers import LlamaForSequenceClassification

            config.num_labels = 1
            return LlamaForSequenceClassification(config)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_pretrained(cfg: TrainConfig, dtype: torch.dtype, ds_config: Optional[Dict[str, Any]],
                    tokenizer: Any = None) -> torch.nn.Module:
    global _hf_zero3_config
    import_modeling()
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    _hf_zero3_config = None  # a load without ds_config (export, prompt-eval) must not partition
    problem = pickled_weights_problem(Path(cfg.model.path))
    if problem is not None:
        raise UserError(problem)
    quantized = quantization_problems("model.path", Path(cfg.model.path))  # at the load: the directory picks no quantizer
    if quantized:
        raise UserError(quantized[0])
    if ds_config is not None and cfg.zero.stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        _hf_zero3_config = HfDeepSpeedConfig(ds_config)
    auto, head = AutoModelForCausalLM, {}
    if scalar_head(cfg):  # a causal LM's body + a new score head (num_labels=1); the pad id finds the last token
        auto, head = AutoModelForSequenceClassification, {"num_labels": 1}
        if tokenizer is not None:
            head["pad_token_id"] = tokenizer.pad_token_id
    with no_custom_code("model.path", str(cfg.model.path)), new_head_kept_in_log(bool(head)):
        return auto.from_pretrained(
            cfg.model.path,
            **head,
            dtype=dtype,
            attn_implementation=cfg.model.attn_implementation.value,
            trust_remote_code=False,
            use_safetensors=True,  # never a pickle from a model directory (pickled_weights_problem)
        )


@contextlib.contextmanager
def new_head_kept_in_log(scalar: bool) -> Iterator[None]:
    """transformers' LOAD REPORT of a reward model's new score head (`score.weight | MISSING`: expected, it is what
    objective=reward trains) goes to the run's log (core/console), not the console; any other report is shown."""
    logger = logging.getLogger("transformers.modeling_utils")

    def only_the_new_head(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        rows = [r.split("|") for r in text.splitlines() if r.count("|") >= 2 and not r.startswith(("Key", "-"))]
        expected = "LOAD REPORT" in text and rows and all(
            k.strip().startswith("score.") and v.strip() == "MISSING" for k, v, *_ in rows)
        if expected:
            keep_in_log(text)
        return not expected

    if scalar:
        logger.addFilter(only_the_new_head)
    try:
        yield
    finally:
        logger.removeFilter(only_the_new_head)


@contextlib.contextmanager
def not_partitioned() -> Iterator[None]:
    """Load another model whole while the policy trains under ZeRO-3: transformers partitions every from_pretrained
    while the HfDeepSpeedConfig of load_pretrained lives, and a frozen model used outside the engine (GRPO's reward
    model) then holds empty parameters ("'weight' must be 2-D" at its first forward)."""
    if _hf_zero3_config is None:
        yield
        return
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(_hf_zero3_config)


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def pickled_weights_problem(path: Path, key: str = "model.path") -> Optional[str]:
    """model.path (or another directory, named by `key`) holding its weights only as pickles (pytorch_model.bin,
    ...): refused, since unpickling can run code and transformers' weights_only reader ends in a traceback on
    anything unusual. None when safetensors are there (transformers then reads only those)."""
    if not path.is_dir() or next(path.glob("*.safetensors"), None) is not None:
        return None
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not pickles:
        return None
    return (f"{key}: {path} holds its weights as pickles ({', '.join(pickles[:3])}) and no *.safetensors; "
            "dsrecipes loads model weights only from safetensors (a pickle can run code when loaded). Convert them "
            "once, e.g. AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir), and point "
            f"{key} at the result")


def add_lora(cfg: TrainConfig, model: torch.nn.Module) -> torch.nn.Module:
    """Wrap in peft LoRA. `only_optimize_lora=false` trains the base weights too (DeepSpeed-Chat's meaning)."""
    import peft

    lora = cfg.model.lora
    targets = lora_targets(lora.target_modules, model)
    peft_config = peft.LoraConfig(
        task_type="SEQ_CLS" if scalar_head(cfg) else "CAUSAL_LM",  # SEQ_CLS: peft trains the score head whole
        modules_to_save=["score"] if scalar_head(cfg) else None,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
    )
    model = peft.get_peft_model(model, peft_config)
    if not lora.only_optimize_lora:
        for param in model.parameters():
            param.requires_grad_(True)
    return model


def lora_targets(names: List[str], model: torch.nn.Module) -> Any:
    """`model.lora.target_modules` for peft: ["all-linear"] as peft's string, else the names, each of which must name
    a linear layer of this model (peft adapts those that match and says nothing of the others, so the Llama names
    of LLaMA-Factory's `all` would adapt two of Phi-3's four kinds of layer)."""
    if list(names) == [ALL_LINEAR]:
        return ALL_LINEAR
    linear = sorted({n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"})
    missing = [t for t in names if not any(n == t or n.endswith("." + t) for n in linear)]
    if missing:
        kinds = sorted({n.rpartition(".")[2] for n in linear})
        raise UserError(f"model.lora.target_modules: {', '.join(missing)} name no linear layer of this model (its "
                        f"linear layers: {', '.join(kinds)}); name those, or [{ALL_LINEAR}] for every linear layer but "
                        "the output one (LLaMA-Factory's lora_target: all)")
    return list(names)


def trainable_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def count_parameters(model: torch.nn.Module) -> Tuple[int, int]:
    """(trainable, total) parameter counts (ZeRO-3 partitioned parameters report their full size)."""

    def numel(p: torch.nn.Parameter) -> int:
        return getattr(p, "ds_numel", p.numel())

    params = list(model.parameters())
    return sum(numel(p) for p in params if p.requires_grad), sum(numel(p) for p in params)

