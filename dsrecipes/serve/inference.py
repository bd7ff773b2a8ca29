"""Load any model a run produces (or starts from) and talk to it with the run's template: prompt-eval and chat.

Accepted paths (`resolve_model_path`):
  a run directory   RUN/export (or, for a baseline, RUN/export_init, else the run's base model at model.path)
  a full export     a directory with config.json (also a LoRA export merged into the base)
  an adapter export a directory with adapter_config.json (LoRA only): loaded onto the base it names
  a base model      any Hugging Face model directory (config.json + tokenizer)
Before transformers reads a directory, `check_loadable` refuses an export this user did not sign (unless trusted
with --trust-checkpoint), a damaged one, and any directory that needs its own code (auto_map); `*.bin` weights are
read weights_only. The prompt is rendered, in a sandboxed child process with time, memory and output limits
(chat_sandbox.py), by the chat template of the fine-tuned export, which is the training template (serving.py); tokens are produced the way training produced them (prompt as one text, a reply continuing it without
a SentencePiece start marker, data/render/spm.py), and generation stops at the export's end-of-turn tokens.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

import dsrecipes.boundary.trust as trust
from dsrecipes.boundary.chat_sandbox import render
from dsrecipes.config.lf_translate import lf_command_file
from dsrecipes.config.load import load_run_config
from dsrecipes.core.errors import UserError, no_custom_code
from dsrecipes.core.export_dir import EXPORT_DIR, EXPORT_INFO, EXPORT_INIT_DIR, scorer_refusal
from dsrecipes.core.tokenizer import NO_DIRECTORY_CODE, custom_code_problems, read_json
from dsrecipes.data.render.spm import continuation_encoder
from dsrecipes.run.preflight import check_model_dir

Messages = List[Dict[str, Any]]


@dataclass
class ModelPath:
    path: Path  # the directory to load (config.json or adapter_config.json inside)
    adapter: bool  # LoRA adapter only: load `base` first
    base: Optional[Path] = None
    run_dir: Optional[Path] = None  # the run it came from, when known (its config.yaml and validation data)


def resolve_model_path(arg: str, baseline: bool = False, retry: str = "dsrecipes chat MODEL") -> ModelPath:
    """`arg` (see module doc) -> what to load, after `check_loadable` passed for every directory that will be
    loaded. `baseline`: a run directory means its starting model. `retry`: the command named by a trust refusal."""
    p = Path(arg).expanduser().resolve()
    if (p / "config.yaml").is_file() and not (p / "config.json").is_file():
        return _from_run(p, baseline, retry)
    if (p / "adapter_config.json").is_file():
        check_loadable(p, retry, adapter=True)
        if adapter_config(p).get("task_type") == "SEQ_CLS":  # peft would put a scoring adapter on a causal LM
            run = _run_of(p) or p
            raise UserError(f"{p}: a LoRA adapter of a reward model (task_type SEQ_CLS: objective=reward) scores "
                            "answers and does not write them, so it cannot chat or answer prompts; merge it to score "
                            f"pairs: dsrecipes export {run} --lora merged --out MERGED && dsrecipes score MERGED "
                            "--pairs PAIRS.jsonl")
        base = adapter_config(p).get("base_model_name_or_path")
        if not base or not isinstance(base, str) or not (Path(base) / "config.json").is_file():
            raise UserError(f"{p}: a LoRA adapter whose base model {base!r} is not a local model directory here")
        check_loadable(Path(base), retry)
        return ModelPath(p, True, Path(base), _run_of(p))
    if (p / "config.json").is_file():
        check_loadable(p, retry)
        return ModelPath(p, False, None, _run_of(p))
    lf_file = lf_command_file(arg, "chat") if retry.startswith("dsrecipes chat ") else None  # llamafactory-cli chat
    raise UserError(lf_file or f"{arg}: not a run directory, a Hugging Face model directory (config.json) or a LoRA "
                    "adapter export (adapter_config.json)")


def adapter_config(model_dir: Path) -> Dict[str, Any]:
    """`model_dir`/adapter_config.json as a JSON object, or one UserError naming the file."""
    path = model_dir / "adapter_config.json"
    try:
        data = read_json(path)  # bounded: check_loadable read it so, but it may have been replaced since
    except (OSError, ValueError) as exc:  # UnicodeDecodeError, JSONDecodeError and Unreadable are ValueErrors
        raise UserError(f"{path}: unreadable ({exc}); nothing was loaded") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: holds a {type(data).__name__}, not a JSON object; nothing was loaded")
    return data


def check_loadable(model_dir: Path, retry: str, adapter: bool = False, scorer: bool = False) -> None:
    """Before anything of `model_dir` is read by transformers: a dsrecipes export (it has dsrecipes_export.json)
    must be signed by this user or trusted on the command line (trust.py) and hold its files as written; any model
    directory is refused when it needs its own code (auto_map, preflight.check_model_dir); a reward model (a
    sequence classifier) is refused for generation, naming `dsrecipes score` (`scorer`: the caller scores with it)."""

    trust.check_export(model_dir, retry)
    problems = custom_code_problems("model", model_dir) if adapter else check_model_dir("model", model_dir, False)
    if problems:
        raise UserError(problems)
    refusal = None if adapter or scorer else scorer_refusal(model_dir)  # as a causal LM, a reward model babbles
    if refusal:
        raise UserError(refusal)


def _from_run(run: Path, baseline: bool, retry: str) -> ModelPath:
    if baseline:
        if (run / EXPORT_INIT_DIR / "config.json").is_file():
            check_loadable(run / EXPORT_INIT_DIR, retry)
            return ModelPath(run / EXPORT_INIT_DIR, False, None, run)

        base = load_run_config(run).model.path  # a real model: the model the run started from
        if base and (Path(base) / "config.json").is_file():
            check_loadable(Path(base), retry)
            return ModelPath(Path(base), False, None, run)
        raise UserError(f"{run}: no {EXPORT_INIT_DIR}/ and no local base model at model.path to compare against")
    if not (run / EXPORT_DIR).is_dir():
        raise UserError(f"{run}: the run has no {EXPORT_DIR}/ (trainer.export=false?); write one with "
                        f"`dsrecipes export {run} --out {run / EXPORT_DIR}`")
    if not (run / EXPORT_DIR / EXPORT_INFO).is_file():  # a run's export is signed: never load one without it
        raise UserError(f"{run / EXPORT_DIR}: the run's export has no {EXPORT_INFO} (its signed list of files); "
                        f"nothing was loaded. Write it again with `dsrecipes export {run} --out {run / EXPORT_DIR}`")
    found = resolve_model_path(str(run / EXPORT_DIR), retry=retry)
    found.run_dir = run
    return found


def _run_of(model_dir: Path) -> Optional[Path]:
    info = model_dir / EXPORT_INFO
    if not info.is_file():
        return None
    try:  # check_loadable read it as an object; bounded again, it may have been replaced since
        record = read_json(info)
    except (OSError, ValueError):
        return None
    run = record.get("run_dir") if isinstance(record, dict) else None
    return Path(run) if isinstance(run, str) and run and (Path(run) / "config.yaml").is_file() else None


class ChatModel:
    """A loaded model plus the tokenizer whose chat template renders the run's format."""

    def __init__(self, where: ModelPath, chat_template: Optional[str] = None, stop_ids: Optional[List[int]] = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.where = where
        with no_custom_code("model", str(where.path)), loading(where.path, "a chat model"):
            self.tokenizer = AutoTokenizer.from_pretrained(str(where.path), trust_remote_code=False)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        if not self.tokenizer.chat_template:
            raise UserError(f"{where.path}: the tokenizer has no chat_template, so prompts cannot be rendered")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        device = "cuda" if torch.cuda.is_available() else "cpu"
        source = where.base if where.adapter else where.path
        with loading(source, "a chat model"), weights_only_refusal(source):  # *.bin: torch.load(weights_only=True)
            model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, **NO_DIRECTORY_CODE)
            if where.adapter:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(where.path))
                model.generation_config = _generation_config(where.path, model.generation_config)
        self.model = model.to(device).eval()
        self.model.generation_config = greedy_config(self.model.generation_config, where.path,
                                                     int(self.model.config.vocab_size))
        self.stop_ids = stop_ids if stop_ids is not None else _as_list(self.model.generation_config.eos_token_id)
        if not self.stop_ids and self.tokenizer.eos_token_id is not None:
            self.stop_ids = [self.tokenizer.eos_token_id]
        self._continue = continuation_encoder(self.tokenizer.backend_tokenizer)

    def prompt_text(self, messages: Messages, tools: Optional[list] = None) -> str:
        return render(self.tokenizer, messages, tools, add_generation_prompt=True, where=self.where.path)

    def encode(self, text: str, continuation: bool = False) -> List[int]:
        if continuation and self._continue is not None:
            return self._continue([text], add_special_tokens=False)[0].ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def generate(self, prompt_ids: List[int], max_new_tokens: int, streamer: Any = None) -> List[int]:
        """Greedy continuation of `prompt_ids`, up to and including the first end-of-turn token."""
        ids = torch.tensor([prompt_ids], device=self.model.device)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=self.stop_ids, pad_token_id=self.tokenizer.pad_token_id,
                                  streamer=streamer)
        return out[0, len(prompt_ids):].tolist()

    def answer_text(self, new_ids: List[int]) -> str:
        return self.tokenizer.decode(new_ids, skip_special_tokens=True).strip()

    @torch.no_grad()
    def reference_loss(self, messages: Messages, tools: Optional[list], reference: str) -> float:
        """Mean next-token loss of `reference` as the reply to `messages`, with its end-of-turn text, tokenized the
        way training tokenizes a reply (the trained span)."""
        prompt = self.prompt_text(messages, tools)
        full = render(self.tokenizer, messages + [{"role": "assistant", "content": reference}], tools,
                      where=self.where.path)
        reply = full[len(prompt):].rstrip() if full.startswith(prompt) else reference + (self.tokenizer.eos_token or "")
        prompt_ids, reply_ids = self.encode(prompt), self.encode(reply, continuation=True)
        ids = torch.tensor([prompt_ids + reply_ids], device=self.model.device)
        labels = torch.full_like(ids, -100)
        labels[0, len(prompt_ids):] = ids[0, len(prompt_ids):]
        return float(self.model(input_ids=ids, labels=labels, use_cache=False).loss)


@contextmanager
def weights_only_refusal(path: Path) -> Iterator[None]:
    """A model file that is a pickle holding more than tensors (transformers loads `*.bin` weights_only): one
    message instead of a traceback."""

    try:
        yield
    except pickle.UnpicklingError as exc:
        raise UserError(f"{path}: refusing to load its weights: a pickle that holds more than tensors "
                        f"({str(exc).splitlines()[0]}); nothing of it ran")


@contextmanager
def loading(path: Path, what: str) -> Iterator[None]:
    """transformers / peft reading a model directory (a base model, a download: nobody signed it): a file it cannot
    use (a tokenizer.json that is not JSON, a config value of the wrong type, a state dict of another shape) is one
    message naming the directory, not the library's traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises on a broken directory
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{path}: does not load as {what} ({type(exc).__name__}: {first}); nothing was loaded") from None


def _as_list(value: Any) -> List[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _generation_config(path: Path, fallback: Any) -> Any:
    from transformers import GenerationConfig

    if (path / "generation_config.json").is_file():
        try:
            return GenerationConfig.from_pretrained(str(path))
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"{path / 'generation_config.json'}: unreadable ({type(exc).__name__}); nothing was loaded")
    return fallback


def greedy_config(loaded: Any, path: Path, vocab_size: int) -> Any:
    """What generation uses, whatever the model directory's generation_config.json says: greedy decoding, one beam,
    and only its token ids (end of turn, padding, start), each checked to be a token of the model. Beams,
    sampling, penalties and lengths of the file are not carried over (`num_beams: 64` once ended chat in a
    traceback); a token id that is not one is one message naming the file and key."""
    from transformers import GenerationConfig

    ids: Dict[str, Any] = {}
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(loaded, key, None)
        items = value if isinstance(value, (list, tuple)) else [value]
        if value is not None and not all(type(v) is int and 0 <= v < vocab_size for v in items):
            shown = value if type(value) is int else type(value).__name__
            raise UserError(f"{path / 'generation_config.json'}: {key}: expected a token id (or a list of them) "
                            f"below the vocabulary size {vocab_size}, got {shown}; nothing was generated")
        ids[key] = list(value) if isinstance(value, tuple) else value
    return GenerationConfig(**ids, do_sample=False, num_beams=1, use_cache=True)
