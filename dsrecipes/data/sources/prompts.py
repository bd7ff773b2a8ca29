"""Prompt rows -> checked prompts (a prompt conversation and an optional reference answer), for `objective.rows=prompt`.

Online objectives (`objective=grpo`) read prompts only: the completions are sampled by the policy during training.
Formats (per source, `format`):
- `sharegpt`: `conversations` holds the prompt turns, ending with a user (or tool output) turn; `system` / `tools`
  as for SFT rows.
- `openai`: `prompt` (TRL's column; `messages` is read when there is no `prompt`) is a message list ending with a
  user turn; a system message opening it is its system prompt.
The reference answer (what the built-in reward checks compare with, objectives/rewards.py) is the row's
`reference` field, else its `answer` field: a string or a number (kept as text), absent or null for none.

Every malformed row is a bad row (counted by reason, `file:line`, quarantined or fatal per `dataset.bad_rows`): the
checks of a pair's prompt (`preference.prompt_conversation`), plus `bad_value` for a reference that is not text or a
number. `prompt_too_long` is decided after tokenization (data/render/prompt_encode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from dsrecipes.core.schema import DEFAULT_MAX_ROW_BYTES, DatasetFormat, SourceConfig
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.files import RawRow, parse_row
from dsrecipes.data.sources.preference import prompt_conversation
from dsrecipes.data.sources.sharegpt import Conversation, Role, sample_id

REFERENCE_COLUMNS = ("reference", "answer")  # the first present (and not null) is the reference answer


@dataclass
class Prompt:
    prompt: Conversation  # the prompt turns, system, tools, id and where it was read
    reference: Optional[str]


def prompt_of(row: RawRow, source: SourceConfig, roles: Dict[str, Role]) -> Prompt:
    """A row as read -> Prompt, or BadRow (the row's own problem)."""
    if row.error is not None:
        raise row.error
    raw = row.value
    if not isinstance(raw, dict):
        raise BadRow(BadReason.not_an_object, f"row is a {type(raw).__name__}")
    if source.format is DatasetFormat.openai and source.columns.prompt not in raw and source.columns.messages in raw:
        raw = {**raw, source.columns.prompt: raw[source.columns.messages]}
    try:
        conv = prompt_conversation(raw, source, roles)
    except RecursionError:
        raise BadRow(BadReason.too_deep, "nested too deep to read") from None
    conv.id, conv.source = sample_id(raw, row, source), source.name
    conv.path, conv.loc, conv.element = row.path, row.loc, row.element
    return Prompt(conv, _reference(raw))


def _reference(raw: Dict[str, Any]) -> Optional[str]:
    for key in REFERENCE_COLUMNS:
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise BadRow(BadReason.bad_value, f"{key!r} must be a string or a number, got {type(value).__name__}")
        return str(value)
    return None


def parse_prompt_item(raw: Optional[bytes], path: str, loc: int, source: SourceConfig, roles: Dict[str, Role], *,
                      limit: int = DEFAULT_MAX_ROW_BYTES, element: bool = False) -> Prompt:
    """One raw line of a stream or a presharded part (None: longer than the row limit) -> Prompt, or BadRow."""
    if raw is not None and len(raw) > limit:
        raw = None
    return prompt_of(parse_row(path, None if element else loc, raw, loc if element else None, limit=limit), source,
                     roles)


def prompt_row(prompt: Prompt) -> Dict[str, Any]:
    """A checked prompt in the canonical form `dsrecipes shard` writes (`PROMPT_ROW_FORMAT`): sharegpt columns and
    `reference`, roles named by their `Role` value."""
    conv = prompt.prompt
    row: Dict[str, Any] = {"id": conv.id, "conversations": [{"from": t.role.value, "value": t.content}
                                                            for t in conv.turns]}
    if conv.system is not None:
        row["system"] = conv.system
    if conv.tools is not None:
        row["tools"] = conv.tools
    if prompt.reference is not None:
        row["reference"] = prompt.reference
    return row
