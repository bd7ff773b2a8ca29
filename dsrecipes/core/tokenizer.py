"""Loading a run's tokenizer, torch-free (transformers' tokenizer classes need no torch), and refusing a model or
tokenizer directory that names its own Python code or links to files outside it. The launching process, the data layer and the ranks all load the
tokenizer from here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

from dsrecipes.core.errors import ConfigError, UserError, no_custom_code
from dsrecipes.core.fileio import MAX_JSON_BYTES, Unreadable, read_json_file
from dsrecipes.core.paths import TINY_TOKENIZER_DIR
from dsrecipes.core.schema import TrainConfig

# Every load of a model directory passes these: the directory chooses no code. Its own Python (auto_map) stays off,
# and the attention is transformers' default, never what its config.json names: `attn_implementation:
# "org/repo"` (or flash_attention_2 without flash-attn installed) makes transformers download that Hub kernel with
# the `kernels` package and load its native code. (Training passes model.attn_implementation, a closed choice.)
NO_DIRECTORY_CODE = {"trust_remote_code": False, "attn_implementation": None}


def tokenizer_dir(cfg: TrainConfig) -> str:
    """Where the tokenizer loads from, `~` expanded here, at the point of use: commands that read a composed config
    without the launch's derived defaults (inspect-data, chat) load from the same place as train."""
    return os.path.expanduser(cfg.model.tokenizer_path or cfg.model.path or str(TINY_TOKENIZER_DIR))


def check_no_custom_code(cfg: TrainConfig) -> None:
    """Before anything launches: the model directory's config and the tokenizer load without running their code
    (ConfigError otherwise); the weights are loaded by the ranks."""
    from transformers import AutoConfig

    if cfg.model.path:
        with no_custom_code("model.path", cfg.model.path):
            AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=False)
    load_tokenizer(cfg)


def load_tokenizer(cfg: TrainConfig):
    """The run's tokenizer, with a pad token (eos, else unk) so that every collate pads the same way."""
    from transformers import AutoTokenizer

    path = tokenizer_dir(cfg)
    key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    if os.path.isdir(path) and outside_link_problems(key, Path(path)):
        raise ConfigError(outside_link_problems(key, Path(path)))
    try:
        with no_custom_code(key, path):
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - no such directory, no tokenizer files, an uncached Hub id offline,
        # a config value of the wrong type (huggingface_hub's StrictDataclassFieldValidationError: an Exception)
        raise ConfigError(f"{key}: {path} does not load as a tokenizer: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def custom_code_problems(key: str, path: Path) -> List[str]:
    """A model or tokenizer directory that names its own Python code (`auto_map` in config.json,
    tokenizer_config.json or adapter_config.json), or holds a link leading outside it (`outside_link_problems`):
    refused by every command (train, chat, prompt-eval, export, score)."""
    links = outside_link_problems(key, path)
    if links:
        return links
    for name in ("config.json", "tokenizer_config.json", "adapter_config.json"):
        try:
            found = read_json(path / name)
        except Unreadable as exc:
            return [f"{key}: {path / name}: {exc}; nothing was loaded"]
        except (OSError, ValueError):
            continue
        if isinstance(found, dict) and found.get("auto_map"):
            return [f"{key}: {path} needs its own Python code to load ({name} auto_map); dsrecipes never runs code "
                    "from a model directory: use a model that transformers supports natively"]
    return quantization_problems(key, path)


def read_json(path: Path) -> object:
    """A model or tokenizer directory's JSON file (config.json, tokenizer_config.json, adapter_config.json), read
    within bounds (fileio.read_json_file): Unreadable for a FIFO or device (never waited on), a file over
    MAX_JSON_BYTES (never read whole) or JSON nested too deeply for Python's parser (json.loads' RecursionError, which
    transformers' own parse of the same file ends in as a traceback); OSError when it cannot be opened, ValueError
    when it is not UTF-8 JSON."""
    return read_json_file(path, "JSON nested too deeply to be a model's settings", limit=MAX_JSON_BYTES)


def config_labels(config: Path) -> Tuple[int, str]:
    """The number of labels config.json declares (transformers' default is 2) and its *ForCausalLM architecture
    ('' if none), or UserError naming the file."""
    try:
        data = read_json(config)  # bounded, as custom_code_problems read it just before (it may have changed since)
    except (OSError, ValueError) as exc:
        raise UserError(f"{config}: not a readable JSON model config ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{config}: holds a {type(data).__name__}, not a model config (a JSON object)")
    archs = data.get("architectures")
    generator = next((a for a in archs if isinstance(a, str) and a.endswith("ForCausalLM")), "") \
        if isinstance(archs, list) else ""
    id2label = data.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return len(id2label), generator
    labels = data.get("num_labels", 2)
    return (labels if isinstance(labels, int) else -1), generator


class NotAScorer(NamedTuple):
    """What a model directory's config.json declares instead of a scorer's one-label head."""

    labels: int  # its number of labels (config_labels: transformers' default 2, -1 when not a number)
    generator: str  # its *ForCausalLM architecture, '' if none: then it has no score head at all


def not_a_scorer(config: Path) -> Optional[NotAScorer]:
    """Whether a model directory is a scorer, judged from its config.json before anything loads: None when it
    declares one label (a scalar score: an objective=reward export, any sequence classifier with one label), else
    what it declares instead. Everything that loads a scorer (dsrecipes score, objective.reward_model) asks this and
    phrases its own refusal: transformers would load any model as a sequence classifier with a new, random head.
    UserError naming the file when config.json is no readable model config."""
    labels, generator = config_labels(config)
    return None if labels == 1 else NotAScorer(labels, generator)


def _quantization(config: object, depth: int = 0) -> object:
    """The `quantization_config` of a config.json object or of one of its sub-configs (text_config, ...: where
    transformers' get_text_config looks), else None."""
    if not isinstance(config, dict) or depth > 3:
        return None
    if config.get("quantization_config") is not None:
        return config["quantization_config"]
    return next((q for v in config.values() if (q := _quantization(v, depth + 1)) is not None), None)


def quantization_problems(key: str, path: Path) -> List[str]:
    """A model directory whose config.json carries a `quantization_config`: transformers then picks a quantizer by
    its `quant_method` and follows it (imports optional packages, and mxfp4 / fp8 methods fetch Hub kernels with
    the `kernels` package and load their native code). dsrecipes loads full-precision safetensors weights only, so
    the directory's choice is refused before any load, at every load (train's ranks, chat, prompt-eval, export,
    score, the reward model)."""
    try:
        found = _quantization(read_json(Path(path) / "config.json"))
    except Unreadable as exc:
        return [f"{key}: {Path(path) / 'config.json'}: {exc}; nothing was loaded"]
    except (OSError, ValueError):
        return []  # no config.json, or unreadable: the load's own check names it
    if found is None:
        return []
    method = found.get("quant_method") if isinstance(found, dict) else None
    named = f"quant_method {method!r}" if isinstance(method, str) else "quantization_config"
    return [f"{key}: {path} is a quantized model (config.json {named}); dsrecipes loads full-precision safetensors "
            "weights only and lets no model directory choose a quantizer (it can import packages or download "
            "kernels): use the model's unquantized release"]


MAX_ENTRIES = 10000  # a model directory holds tens of files; one holding more is refused, not partly checked


def outside_link_problems(key: str, path: Path) -> List[str]:
    """A file of a model or tokenizer directory that is a symbolic link leading outside it: transformers would read
    it as the model's own (a chat_template.jinja linked to ~/.aws/credentials would be rendered into every prompt
    and trained on; a git clone or a tarball can carry such links). A hub cache snapshot's links lead to its
    repository's blobs (`models--ORG--NAME/blobs`): inside that repository folder is inside. Every entry at every
    depth is checked (a loader may open any of them: additional_chat_templates/NAME.jinja); a directory of more than
    MAX_ENTRIES entries is refused whole rather than checked in part (a link hidden past the bound was loaded)."""
    if not os.path.isdir(path):
        return []  # a Hub id, or nothing there: the load names it
    root = Path(os.path.realpath(path))
    hub = root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--"))
    inside = root.parent.parent if hub else root
    seen, pending = 0, [str(path)]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if seen > MAX_ENTRIES:
                        return [f"{key}: {path} holds more than {MAX_ENTRIES} files and folders; a model or "
                                "tokenizer directory holds tens, and dsrecipes checks each one before loading it: "
                                "point the key at the model's own directory"]
                    if entry.is_symlink():
                        if not Path(os.path.realpath(entry.path)).is_relative_to(inside):
                            return [f"{key}: {entry.path} is a link leading outside {path}; dsrecipes reads only a "
                                    "model directory's own files (copy the file into the directory if it is meant "
                                    "to be there)"]
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
        except OSError as exc:
            return [f"{key}: {path}: cannot list {exc.filename or path} ({exc.strerror or exc}) to check its files"]
    return []
