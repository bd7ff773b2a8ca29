"""A tokenizer directory read without transformers (and so without torch): `tokenizer.json` through the `tokenizers`
library, with the special tokens and the chat template of `tokenizer_config.json` (and `special_tokens_map.json`,
`chat_template.jinja` / `chat_template.json`) added the way transformers' fast tokenizer adds them.

It answers what the template rules ask a tokenizer (data/render/template.py `check_template`, data/render/template_choice.py
`choose_template`): is a text one token, the eos token, the chat template - so `dsrecipes validate` runs the same
rules a run runs on the loaded tokenizer, in milliseconds. A directory without `tokenizer.json` (a SentencePiece-only
tokenizer) is not read here: the run checks it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from tokenizers import AddedToken, Tokenizer

from dsrecipes.core.fileio import read_json_file

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class FileTokenizer:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]`, `eos_token`, `chat_template`: nothing else."""

    def __init__(self, directory: Path):
        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.name_or_path = str(directory)  # what a message about its chat template names
        config = {**_json(directory / "special_tokens_map.json"), **_json(directory / "tokenizer_config.json")}
        special = [_content(config.get(k)) for k in _SPECIAL_KEYS]
        special += [_content(t) for t in config.get("additional_special_tokens") or []]
        special += [_content(t) for t in (config.get("added_tokens_decoder") or {}).values()]
        self._tokenizer.add_special_tokens([AddedToken(t, special=True) for t in special if t])
        self.eos_token: Optional[str] = _content(config.get("eos_token"))
        self.chat_template: Any = config.get("chat_template") or _chat_template_file(directory)

    def __call__(self, text: str, add_special_tokens: bool = False) -> Dict[str, List[int]]:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}


def open_tokenizer(directory: Path) -> Optional[FileTokenizer]:
    """The directory's tokenizer, or None when it has no readable `tokenizer.json`."""
    try:
        return FileTokenizer(directory) if (directory / "tokenizer.json").is_file() else None
    except Exception:  # noqa: BLE001 - a file `tokenizers` cannot read: the run's loader reports it
        return None


def _json(path: Path) -> Dict[str, Any]:
    try:
        data = read_json_file(path, "nested too deeply")  # bounded: the directory may be anyone's
    except (OSError, ValueError):  # absent or damaged; nested too deeply, too large, a FIFO: preflight names it
        return {}
    return data if isinstance(data, dict) else {}


def _content(token: Any) -> Optional[str]:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _chat_template_file(directory: Path) -> Optional[str]:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    return _json(directory / "chat_template.json").get("chat_template")
