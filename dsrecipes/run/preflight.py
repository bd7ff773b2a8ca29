"""What a run needs from this machine's files, checked before any rank starts and by `dsrecipes validate`.

Nothing here loads a model or writes a file: it looks at paths. An output or cache directory that cannot be
created or written, an output path below a file, a model directory without config.json or weights, a tokenizer
path that is a file, a model that needs custom code: each is one `key: message` line (exit 2), instead of a
traceback from deep inside transformers after the ranks started.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Sequence

from dsrecipes.core.errors import UserError
from dsrecipes.core.export_dir import EXPORT_DIR
from dsrecipes.core.fileio import Unreadable, dangling_link_problem, loads_bounded, not_regular
from dsrecipes.core.hub import is_hub_id
from dsrecipes.core.paths import TINY_TOKENIZER_DIR
from dsrecipes.core.rundir import MARKER_FILE
from dsrecipes.core.schema import OffloadDevice, TrainConfig
from dsrecipes.core.tokenizer import custom_code_problems, read_json
from dsrecipes.data.prepare.cache import cache_root
from dsrecipes.data.render.template import check_template
from dsrecipes.data.render.template_choice import choose_template
from dsrecipes.data.render.tokenizer_files import open_tokenizer
from dsrecipes.data.sources.files import expand_paths
from dsrecipes.data.sources.preference import check_sources
from dsrecipes.data.sources.registry import resolve_sources, validation_files

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
                   "*.gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Every file a tokenizer load (ours: data/render/tokenizer_files.py, or transformers') may open in its directory.
TOKENIZER_READS = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


def check_environment(cfg: TrainConfig) -> List[str]:
    """Every problem with the run's paths on this machine (empty when there is none)."""

    problems: List[str] = []
    if cfg.trainer.output_dir:
        problems += writable_dir("trainer.output_dir", Path(cfg.trainer.output_dir).expanduser())
    problems += writable_dir("data.cache_dir", cache_root(cfg))
    nvme = OffloadDevice.nvme in (cfg.offload.param, cfg.offload.optimizer)
    if nvme and cfg.offload.nvme_path:  # DeepSpeed makes its swap folders there in every rank (os.makedirs)
        problems += writable_dir("offload.nvme_path", Path(cfg.offload.nvme_path).expanduser())

    model: List[str] = []
    path, tokenizer_path = ((p if not is_hub_id(p) else None) for p in (cfg.model.path, cfg.model.tokenizer_path))
    if path:  # a hub id is checked as one (hub.check_hub_paths) and its snapshot once resolved (entry.check_machine)
        model = check_model_dir("model.path", Path(path).expanduser(), cfg.model.trust_remote_code)
    if tokenizer_path:
        problems += check_tokenizer_dir("model.tokenizer_path", Path(tokenizer_path).expanduser())
    elif path and not cfg.model.tokenizer_path and not model:  # a broken model directory is one problem, not two
        problems += check_tokenizer_dir("model.path", Path(path).expanduser())
    return problems + model + check_data_names(cfg)


def check_data_names(cfg: TrainConfig) -> List[str]:
    """What a run would refuse about the data a config names, found without reading a row: `dataset.use` entries
    missing from `dataset.registry` (or a registry entry it cannot read), a source whose rows the objective cannot
    train on (preference entries under SFT, plain ones under DPO), a validation file that is also a
    training file (its rows would be evaluated after being trained on)."""
    from dsrecipes.data.strategies.rules import reads_sources  # lazy: else `commands.validate` imports numpy 0.11 s

    if not reads_sources(cfg):  # presharded reads the shards' manifest, not the dataset's sources
        return []
    try:
        sources = resolve_sources(cfg.dataset, [])
        check_sources(cfg.objective.rows, sources)  # a ranking entry under SFT, a plain one under DPO (as train)
        train = [f for src in sources for f in expand_paths(src.paths)[0]]
        validation_files(train, expand_paths(cfg.dataset.val_paths)[0], [])
    except UserError as exc:
        return list(exc.problems)
    return []


def check_template_tokens(cfg: TrainConfig) -> List[str]:
    """The template rules a run applies to its loaded tokenizer (data/render/template.py `check_template`, after `auto` is
    decided as the run decides it), applied to the tokenizer's files: no transformers, no torch (`validate`)."""

    where = cfg.model.tokenizer_path or cfg.model.path or str(TINY_TOKENIZER_DIR)
    if not is_hub_id(where) and irregular_files("", Path(where).expanduser(), TOKENIZER_READS):
        return []  # a FIFO would block the read below for ever; check_environment names it
    tokenizer = None if is_hub_id(where) else open_tokenizer(Path(where).expanduser())
    if tokenizer is None:  # a hub id not fetched yet, a SentencePiece-only tokenizer: the run checks it
        return []
    return check_template(choose_template(cfg.template, tokenizer, cfg.model.path), tokenizer)


def writable_dir(key: str, path: Path) -> List[str]:
    """`path` is (or can be made) a directory we may write into. Creates nothing."""
    link = dangling_link_problem(key, path)  # making it would make the link's target
    if link:
        return [link]
    existing: Optional[Path] = next((p for p in [path, *path.parents] if p.exists()), None)
    if existing is None:
        return []
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies below {existing}, which is a file"
        return [f"{key}: {path} {where}; it must be a directory"]
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        return [f"{key}: {path} {what}"]
    return []


def check_model_dir(key: str, path: Path, trust_remote_code: bool) -> List[str]:
    """A local Hugging Face model directory: config.json with a known (or allowed custom) architecture, weights."""
    if not path.exists():
        return []  # reported by the config rules (or resolved as a hub id where that is supported)
    if not path.is_dir():
        return [f"{key}: {path} is a file; give the model's directory (config.json and weights)"]
    odd = irregular_files(key, path, ("config.json", *WEIGHT_PATTERNS, *TOKENIZER_READS))
    if odd:
        return odd
    config_path = path / "config.json"
    if not config_path.is_file():
        return [f"{key}: {path} has no config.json; it is not a Hugging Face model directory{_what_it_is(key, path)}"]
    try:
        config = read_json(config_path)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        return [f"{key}: {config_path} is unreadable ({exc})"]
    problems = [] if trust_remote_code else custom_code_problems(key, path)
    problems += settings_file_problems(key, path)
    if not config.get("auto_map"):
        problems += _known_model_type(key, path, config.get("model_type"))
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        problems.append(f"{key}: {path} has no weights (*.safetensors, pytorch_model*.bin or *.gguf)")
    if not problems:  # weights whose header does not read: one message here, not a traceback in every rank
        damaged = ((f, safetensors_problem(f)) for f in sorted(path.glob("*.safetensors")))
        problems += [f"{key}: {f} is not a readable safetensors file ({why}); the download may be incomplete or "
                     "damaged" for f, why in damaged if why]
    return problems


# parsed with Python's json by transformers wherever the model or its tokenizer loads (every rank, chat, export)
SETTINGS_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def settings_file_problems(key: str, path: Path) -> List[str]:
    """A settings file the ranks' model load parses (SETTINGS_FILES) that is no parser's to read (core/tokenizer.read_json:
    nested too deeply, too large, not a regular file): refused here, not a RecursionError in every rank."""
    problems = []
    for name in SETTINGS_FILES:
        try:
            read_json(path / name)
        except Unreadable as exc:
            problems.append(f"{key}: {path / name}: {exc}; nothing was loaded")
        except (OSError, ValueError):
            continue  # absent, or not JSON: transformers' own message at the load
    return problems


def _what_it_is(key: str, path: Path) -> str:
    """A run directory or a LoRA adapter export where a model directory belongs: the one to name instead."""
    if (path / MARKER_FILE).is_file():
        export = path / EXPORT_DIR
        there = f"{key}={export}" if export.is_dir() else f"dsrecipes export {path} --out DIR, then {key}=DIR"
        return f" but a dsrecipes run directory: its model is {there}"
    if (path / "adapter_config.json").is_file():
        return (" but a LoRA adapter: train on a merged model (dsrecipes export RUN --out DIR merges by default), "
                f"then {key}=DIR")
    return ""


MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit (safetensors: "header too large" beyond it)


def safetensors_problem(path: Path) -> str:
    """What is wrong with a safetensors file's header (8-byte length, then JSON), read without the tensors: a
    truncated or random file is one message here instead of a traceback in every rank."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            size = path.stat().st_size
            if len(raw) < 8:
                return f"{size} bytes, shorter than a header"
            length = int.from_bytes(raw, "little")
            if length > min(size - 8, MAX_SAFETENSORS_HEADER):
                return f"its header claims {length} bytes of {size}"
            # a header of nested brackets: refused here (Unreadable), not a RecursionError traceback in every rank
            header = loads_bounded(fh.read(length), "its header is JSON nested too deeply to be a list of tensors")
    except OSError as exc:
        return exc.strerror or str(exc)
    except Unreadable as exc:
        return str(exc)
    except ValueError as exc:  # JSON and UTF-8 errors
        return f"its header is not JSON: {exc}"
    return "" if isinstance(header, dict) else "its header is not a JSON object"



def _known_model_type(key: str, path: Path, model_type: object) -> List[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if not model_type:
        return [f"{key}: {path}/config.json has no model_type"]
    if model_type not in CONFIG_MAPPING_NAMES:
        return [f"{key}: {path}/config.json: model_type {model_type!r} is not known to this transformers version"]
    return []


def irregular_files(key: str, directory: Path, patterns: Sequence[str]) -> List[str]:
    """`key: FILE is a FIFO, not a regular file ...` for the first entry of `directory` matching `patterns` that a load
    would open but that is not a regular file: a FIFO blocks its reader for ever, a device never ends, a link to
    nothing is a broken download. Nothing is opened."""
    if not directory.is_dir():
        return []
    found = sorted({f for pattern in patterns for f in directory.glob(pattern) if not f.is_file()})
    if not found:
        return []
    odd = found[0]
    what = not_regular(odd) or "not a regular file"
    return [f"{key}: {odd} is {what}, not a regular file; loading would read it (a FIFO blocks for ever). Replace it "
            "with the file, or give another directory"]


def check_tokenizer_dir(key: str, path: Path) -> List[str]:
    if not path.exists():
        return []
    if not path.is_dir():
        return [f"{key}: {path} is a file; the tokenizer is loaded from a directory (tokenizer.json, "
                "tokenizer_config.json, ...)"]
    odd = irregular_files(key, path, TOKENIZER_READS) or settings_file_problems(key, path)
    if odd:
        return odd
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return [f"{key}: {path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})"]
    if key == "model.tokenizer_path":  # a tokenizer of its own loads without its code, whatever trust_remote_code says
        return custom_code_problems(key, path)  # (core/tokenizer.load_tokenizer refuses it in train and inspect-data)
    return []
