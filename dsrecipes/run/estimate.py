"""`dsrecipes estimate [overrides] --gpus-per-node G --nodes N [--gpu-mem-gb M]`: memory per GPU and per node.

Model states come from DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs` and
`estimate_zero3_model_states_mem_needs`, the functions behind the `*_all_cold` tables). Those assume mixed precision,
Adam and full fine-tuning; we use the same byte breakdown, written per component, so that the numbers are exactly
DeepSpeed's in that case (tests check it) and extend to stage 0/1, fp32, other optimizers and LoRA (frozen weights
keep only their parameter bytes). Activations are an approximation for Llama-style decoders, counted per token:
with gradient checkpointing only each layer's input is kept, plus one layer being recomputed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsrecipes.core.choices import ALL_LINEAR
from dsrecipes.core.errors import UserError, no_custom_code
from dsrecipes.core.schema import AttnImpl, OptimizerKind, Precision, TrainConfig
from dsrecipes.core.tokenizer import load_tokenizer, read_json

GIB = 1024**3
BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor default for CPU memory

# (zero stage, offload label (OffloadConfig.label), optimizer offloaded, parameters offloaded): every conf/offload choice that
# has a different memory profile (nvme behaves like cpu for GPU memory and needs little CPU memory).
OPTIONS: List[Tuple[int, str, bool, bool]] = [
    (0, "none", False, False),
    (1, "none", False, False),
    (1, "optimizer=cpu", True, False),
    (2, "none", False, False),
    (2, "optimizer=cpu", True, False),
    (3, "none", False, False),
    (3, "optimizer=cpu", True, False),
    (3, "optimizer=cpu,param=cpu", True, True),
]


@dataclass
class ModelShape:
    total_params: int
    trainable_params: int
    largest_layer_params: int
    hidden: Optional[int] = None
    intermediate: Optional[int] = None
    layers: Optional[int] = None
    heads: Optional[int] = None
    kv_dim: Optional[int] = None
    vocab: Optional[int] = None
    source: str = ""


@dataclass
class Row:
    stage: int
    offload: str
    gpu_model_states: float
    cpu_per_node: float  # the larger of the two below, times BUFFER_FACTOR
    cpu_load: float  # loading the model (times BUFFER_FACTOR)
    cpu_offloaded: float  # what the offload holds while training (times BUFFER_FACTOR)
    gpu_total_no_gc: Optional[float]
    gpu_total_gc: Optional[float]
    fits_no_gc: Optional[bool] = None
    fits_gc: Optional[bool] = None


# ---------------------------------------------------------------------------------------------------------------
# Model states


def optimizer_state_bytes(cfg: TrainConfig) -> int:
    """Bytes of optimizer state per trainable parameter (fp32): Adam keeps two moments, Lion and momentum SGD one."""
    name = cfg.optimizer.name
    if name in (OptimizerKind.adam, OptimizerKind.adamw):
        return 8
    if name is OptimizerKind.lion or (name is OptimizerKind.sgd and cfg.optimizer.momentum > 0):
        return 4
    return 0


def model_states(
    stage: int, opt_off: bool, param_off: bool, shape: ModelShape, cfg: TrainConfig, gpus_per_node: int, nodes: int,
    zero_init: bool,
) -> Tuple[float, float]:  # fmt: skip
    """(bytes per GPU, bytes of CPU per node) for parameters, gradients and optimizer states; the CPU figure is the
    larger of the two in `cpu_parts` (loading the model, then what the offload keeps there), with the buffer factor."""
    gpu, load, offloaded = cpu_parts(stage, opt_off, param_off, shape, cfg, gpus_per_node, nodes, zero_init)
    return gpu, max(load, offloaded) * BUFFER_FACTOR


def cpu_parts(
    stage: int, opt_off: bool, param_off: bool, shape: ModelShape, cfg: TrainConfig, gpus_per_node: int, nodes: int,
    zero_init: bool,
) -> Tuple[float, float, float]:  # fmt: skip
    """(bytes per GPU, CPU per node while the model loads, CPU per node the offload holds while training).

    DeepSpeed's breakdown per parameter: 2 (16-bit param) + 2 (16-bit grad) + 4 (fp32 grad) + 4 (fp32 master)
    + 8 (Adam moments) = "2 + 18". P = all parameters, T = trainable ones (T = P without LoRA). Loading comes
    first and is freed before the optimizer is built, so the CPU a node needs is the larger of the two, never less
    than loading: under LoRA the offloaded states are the adapters' only (16 T bytes), and the load (every rank
    materialising the model in fp32, or its largest layer under zero.Init) is what the node must hold.
    """
    P, T, L = shape.total_params, shape.trainable_params, shape.largest_layer_params
    G = gpus_per_node * nodes
    mixed = cfg.precision.dtype is not Precision.fp32
    p = 2 if mixed else 4  # parameter (and model-gradient) bytes
    opt = 8 + optimizer_state_bytes(cfg)  # fp32 grad partition + fp32 master + optimizer moments: 16 for Adam
    if not mixed and stage == 0:
        opt = optimizer_state_bytes(cfg)  # plain fp32 training keeps no fp32 copies
    load_cpu = 4 * P * gpus_per_node  # every local rank materialises the model in fp32 before DeepSpeed takes it
    if stage == 0:
        return p * P + (p + opt) * T, load_cpu, 0
    if stage in (1, 2):
        if stage == 1:
            gpu = p * P + p * T + (0 if opt_off else opt * T / G)
        else:
            gpu = p * P + (0 if opt_off else (p + opt) * T / G)
        return int(gpu), load_cpu, T * max(4 * G, opt) if opt_off else 0  # (DeepSpeed's zero2 CPU figure)
    layer = 4 * L  # ZeRO-3 gathers the largest layer in full
    load = L * 4 * gpus_per_node if zero_init else load_cpu  # zero.Init: one layer at a time per rank
    if param_off:
        return layer, load, (p * P + opt * T) / nodes
    if opt_off:
        return layer + int(p * P / G), load, opt * T / nodes
    return layer + int((p * P + opt * T) / G), load, 0


# ---------------------------------------------------------------------------------------------------------------
# Activations


def activation_bytes(shape: ModelShape, cfg: TrainConfig, gradient_checkpointing: bool) -> Optional[float]:
    """Approximate activation memory of one micro-batch on one GPU (Llama-style decoder, SDPA attention)."""
    if shape.hidden is None or shape.layers is None or shape.vocab is None:
        return None
    a = 4 if cfg.precision.dtype is Precision.fp32 else 2
    tokens = cfg.trainer.micro_batch_size * cfg.data.cutoff_len
    h, i, kv = shape.hidden, shape.intermediate or 4 * shape.hidden, shape.kv_dim or shape.hidden
    # saved per token and layer: norm inputs, q/k/v, attention output, o_proj input (7h + 2kv) and the MLP (4i)
    per_layer = tokens * (7 * h + 2 * kv + 4 * i) * a
    if cfg.model.attn_implementation is AttnImpl.eager:  # eager attention keeps the probabilities
        per_layer += cfg.trainer.micro_batch_size * (shape.heads or 1) * cfg.data.cutoff_len**2 * a
    logits = tokens * shape.vocab * (a + 8)  # logits, their fp32 upcast for the loss, and its gradient
    if gradient_checkpointing:
        return shape.layers * tokens * h * a + per_layer + logits
    return shape.layers * per_layer + logits


# ---------------------------------------------------------------------------------------------------------------
# Model shape


def model_shape(cfg: TrainConfig, hf_config: Optional[str] = None) -> ModelShape:
    """Parameter counts from a meta-device model (no weights, no memory); model.num_params wins for the total."""
    config, source = _hf_config(cfg, hf_config)
    if config is None:
        if cfg.model.num_params is None:
            raise UserError(
                f"model.path {cfg.model.path!r} has no config.json here and model.num_params is not set; "
                "set model.num_params or pass --hf-config DIR"
            )
        P = cfg.model.num_params
        lora = _lora_guess(cfg, P)
        return ModelShape(P + lora, _trainable(cfg, P, lora), P // 10, source="model.num_params (largest layer: 10%)")
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = sum(p.numel() for p in model.parameters())  # parameters() already counts tied weights once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    lora = _lora_params(cfg, model) if cfg.model.lora.enabled else 0
    if cfg.model.num_params is not None:
        base, source = cfg.model.num_params, f"model.num_params; shape from {source}"
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(
        total_params=base + lora,
        trainable_params=_trainable(cfg, base, lora),
        largest_layer_params=largest,
        hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None),
        layers=config.num_hidden_layers,
        heads=heads,
        kv_dim=kv_heads * head_dim if kv_heads and head_dim else None,
        vocab=config.vocab_size,
        source=source,
    )


def _trainable(cfg: TrainConfig, base: int, lora: int) -> int:
    if cfg.model.lora.enabled and cfg.model.lora.only_optimize_lora:
        return lora
    return base + lora


def _hf_config(cfg: TrainConfig, hf_config: Optional[str]) -> Tuple[Any, str]:
    from transformers import AutoConfig

    where, key = (hf_config, "--hf-config") if hf_config else (cfg.model.path, "model.path")
    if where is not None:
        path = Path(where).expanduser()
        if hf_config or path.is_file() or (path / "config.json").is_file():  # --hf-config is a config, or refused
            return read_hf_config(key, path), str(path)
        if cfg.model.arch:  # the shape the model entry ships, for estimating before the weights are downloaded
            arch = dict(cfg.model.arch)
            return AutoConfig.for_model(arch.pop("model_type"), **arch), f"model.arch of model={cfg.model.name}"
        return None, ""
    from transformers import LlamaConfig


    tiny = cfg.model.tiny  # the embedded model: same shape as dsrecipes.modeling.model.build_tiny_model
    config = LlamaConfig(
        vocab_size=len(load_tokenizer(cfg)), hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers, num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads, max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=tiny.tie_word_embeddings,
    )  # fmt: skip
    return config, "embedded tiny model (model.tiny)"


def read_hf_config(key: str, path: Path) -> Any:
    """transformers' config from `path`, a config.json or the directory holding one. Every problem is one UserError
    naming `key` (the setting or flag that gave the path): no config.json, not a JSON object, no model_type, a
    model type or a field transformers refuses, a config that needs its own code."""
    from transformers import AutoConfig

    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        raise UserError(f"{key}: {path} has no config.json; give a model's config.json or its directory")
    try:
        data = read_json(file)  # bounded: nested too deeply, too large or a FIFO is Unreadable (a ValueError)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise UserError(f"{key}: {file} is unreadable ({exc})") from None
    if not data.get("model_type") and not data.get("auto_map"):
        raise UserError(f"{key}: {file} has no model_type; it is not a Hugging Face model config")
    try:
        with no_custom_code(key, str(path)):
            return AutoConfig.from_pretrained(str(file), trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        first = str(exc).strip().split("\n")[0] or type(exc).__name__  # (transformers goes on with advice)
        raise UserError(f"{key}: {file}: {first}") from None


def _lora_params(cfg: TrainConfig, model: Any) -> int:
    """The parameters peft's adapters add: r x (in + out) for each adapted linear layer (nn.Linear or transformers'
    Conv1D), those whose name ends with a name in model.lora.target_modules (peft's match), or under [all-linear]
    peft's own rule (tuners_utils._maybe_include_all_linear_layers): every one but the output embeddings."""
    import torch
    from transformers.pytorch_utils import Conv1D

    lora, total = cfg.model.lora, 0
    every, output = list(lora.target_modules) == [ALL_LINEAR], model.get_output_embeddings()
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, Conv1D)):
            continue
        named = any(name == t or name.endswith("." + t) for t in lora.target_modules)
        if (module is not output) if every else named:
            total += lora.r * sum(module.weight.shape)  # Linear (out, in), Conv1D (in, out)
    return total


def _lora_guess(cfg: TrainConfig, params: int) -> int:
    return int(params * 0.005) if cfg.model.lora.enabled else 0  # no shape known: ~0.5% is typical for r=8..16


# ---------------------------------------------------------------------------------------------------------------


def estimate(
    cfg: TrainConfig,
    gpus_per_node: int,
    nodes: int,
    gpu_mem_gb: Optional[float] = None,
    hf_config: Optional[str] = None,
) -> Dict[str, Any]:
    shape = model_shape(cfg, hf_config)
    zero_init = cfg.model.path is not None  # dsrecipes.modeling.model loads local models partitioned (zero.Init) under ZeRO-3
    act = {gc: activation_bytes(shape, cfg, gc) for gc in (False, True)}
    rows = []
    for stage, offload, opt_off, param_off in OPTIONS:
        gpu, load, off = cpu_parts(stage, opt_off, param_off, shape, cfg, gpus_per_node, nodes, zero_init)
        cpu = (max(load, off) * BUFFER_FACTOR, load * BUFFER_FACTOR, off * BUFFER_FACTOR)
        row = Row(stage, offload, gpu, *cpu, *(None if act[gc] is None else gpu + act[gc] for gc in (False, True)))
        if gpu_mem_gb is not None:
            limit = gpu_mem_gb * GIB
            # without a model shape the activations are unknown: judge by the model states alone
            row.fits_no_gc = (row.gpu_total_no_gc if row.gpu_total_no_gc is not None else gpu) <= limit
            row.fits_gc = (row.gpu_total_gc if row.gpu_total_gc is not None else gpu) <= limit
        rows.append(row)
    return {"shape": asdict(shape), "gpus_per_node": gpus_per_node, "nodes": nodes, "gpu_mem_gb": gpu_mem_gb,
            "activations_no_gc": act[False], "activations_gc": act[True], "zero_init": zero_init,
            "configured": [cfg.zero.stage, cfg.offload.label], "rows": [asdict(r) for r in rows]}  # fmt: skip


def _gib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def render(cfg: TrainConfig, result: Dict[str, Any]) -> str:
    s = result["shape"]
    lines = [
        f"model {cfg.model.name}: {s['total_params'] / 1e6:.1f}M params ({s['trainable_params'] / 1e6:.2f}M trainable"
        f", largest layer {s['largest_layer_params'] / 1e6:.1f}M) from {s['source']}",
        f"{cfg.precision.dtype.value}, {cfg.optimizer.name.value}, {result['nodes']} node(s) x "
        f"{result['gpus_per_node']} GPU(s), micro batch {cfg.trainer.micro_batch_size} x cutoff {cfg.data.cutoff_len}",
        f"activations per GPU (approx.): {_gib(result['activations_no_gc'])} GiB, "
        f"{_gib(result['activations_gc'])} GiB with gradient checkpointing "
        f"(model.gradient_checkpointing={str(cfg.model.gradient_checkpointing).lower()})",
        "",
        "| zero | offload | GPU model states | GPU total | GPU total (GC) | CPU per node (load / offload) |"
        + (f" fits {result['gpu_mem_gb']:g} GiB |" if result["gpu_mem_gb"] is not None else ""),
        "|---|---|---|---|---|---|" + ("---|" if result["gpu_mem_gb"] is not None else ""),
    ]
    for r in result["rows"]:
        mark = " *" if [r["stage"], r["offload"]] == result["configured"] else ""
        cells = [f"stage{r['stage']}{mark}", r["offload"], _gib(r["gpu_model_states"]), _gib(r["gpu_total_no_gc"]),
                 _gib(r["gpu_total_gc"]),
                 f"{_gib(r['cpu_per_node'])} ({_gib(r['cpu_load'])} / {_gib(r['cpu_offloaded'])})"]  # fmt: skip
        if result["gpu_mem_gb"] is not None:
            known = r["gpu_total_no_gc"] is not None
            fits = "yes" if r["fits_no_gc"] else "with GC" if r["fits_gc"] else "no"
            cells.append(fits if known else f"{fits} (states only)")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\n(GiB; * = the composed config.)")
    lines.extend(_cpu_note(cfg, result))
    return "\n".join(lines)


def _cpu_note(cfg: TrainConfig, result: Dict[str, Any]) -> List[str]:
    """What the CPU column counts, so that a small figure under LoRA is not read as 'the model needs no CPU'."""
    s, per = result["shape"], 8 + optimizer_state_bytes(cfg)
    weight = "4-byte" if cfg.precision.dtype is Precision.fp32 else "2-byte"
    load = "the whole model" + (", under ZeRO-3 only its largest layer (zero.Init)" if result["zero_init"] else "")
    lines = [
        f"CPU per node: the larger of loading the model (each rank materialises {load} in fp32) and "
        f"what the offload keeps there while training (optimizer=cpu: {per} bytes per trainable parameter, fp32 "
        f"master, fp32 gradient and {cfg.optimizer.name.value} state; param=cpu adds the {weight} weights of every "
        "parameter), times DeepSpeed's 1.5x buffer factor. Not counted: data loading, the Python process itself."
    ]
    frozen = s["total_params"] - s["trainable_params"]
    if frozen > 0:
        lines.append(
            f"LoRA: the offloaded optimizer states are the {s['trainable_params'] / 1e6:.2f}M trainable adapter "
            f"parameters' only; the {frozen / 1e6:.1f}M frozen base parameters keep only their {weight} weights "
            "(on the GPU; on the CPU with param=cpu) and have no gradients or optimizer states."
        )
    return lines
