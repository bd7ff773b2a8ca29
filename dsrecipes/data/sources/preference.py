"""Preference rows -> checked pairs (a prompt conversation, a chosen and a rejected answer), for `objective.rows=pair`.

Formats (per source, `format`):
- `sharegpt` (LLaMA-Factory, `ranking: true` in dataset_info.json): `conversations` holds the prompt turns (ending
  with a user turn), `chosen` and `rejected` one assistant message each (`{"from": "gpt", "value": ...}`, or a
  list of exactly one such message); `system` / `tools` as for SFT rows.
- `openai` (TRL conversational): `prompt`, `chosen`, `rejected` are message lists (`{"role", "content"}`); each
  answer list holds exactly one assistant message. A system message opening the prompt is its system prompt.

Every malformed pair is a bad row (counted by reason, `file:line`, quarantined or fatal per `dataset.bad_rows`,
exactly like SFT rows): `missing_side` (no chosen / no rejected), `side_not_assistant` (an answer that is not one
assistant turn), `empty_answer`, `identical_sides`, plus every check of the prompt's messages that SFT rows get
(`missing_conversation`, `unknown_role`, ...); a prompt that does not end with a user (or tool output) turn is a
`bad_value`. `prompt_too_long` is decided after tokenization (data/render/preference_encode.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import DEFAULT_MAX_ROW_BYTES, DatasetFormat, RowKind, SourceConfig
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.files import RawRow, parse_row
from dsrecipes.data.sources.sharegpt import (
    TRAINED_ROLES,
    Conversation,
    Role,
    Turn,
    _message_turns,
    _optional_text,
    _tools_text,
    sample_id,
)


@dataclass
class Pair:
    prompt: Conversation  # the prompt turns (no reply yet), system, tools, id and where it was read
    chosen: str
    rejected: str
    margin: Optional[float] = None  # the row's `margin` (TRL's reward-model column): objective=reward's target gap


def check_sources(rows: RowKind, sources: List[SourceConfig]) -> None:
    """Preference sources only for an objective on pairs (`objective.rows`), and no source that says it is not one."""
    for src in sources:
        if rows is RowKind.pair and src.ranking is False:
            raise ConfigError(f"dataset: source {src.name!r} is not preference data (its registry entry has no "
                              "`ranking: true`); this objective (objective.rows=pair) trains on chosen/rejected pairs")
        if rows is not RowKind.pair and src.ranking:
            raise ConfigError(f"dataset: source {src.name!r} holds preference (ranking) rows; train on it with an "
                              "objective on pairs (objective.rows=pair: objective=dpo, for one)")
        if rows in (RowKind.pair, RowKind.prompt) and src.format is DatasetFormat.alpaca:
            raise ConfigError(f"dataset: source {src.name!r}: {rows.value} rows are read in the sharegpt "
                              "(LLaMA-Factory) or openai (TRL) format, not alpaca")


def pair_of(row: RawRow, source: SourceConfig, roles: Dict[str, Role]) -> Pair:
    """A row as read -> Pair, or BadRow (the row's own problem)."""
    if row.error is not None:
        raise row.error
    raw = row.value
    if not isinstance(raw, dict):
        raise BadRow(BadReason.not_an_object, f"row is a {type(raw).__name__}")
    try:
        pair = _pair(raw, source, roles)
    except RecursionError:
        raise BadRow(BadReason.too_deep, "nested too deep to read") from None
    conv = pair.prompt
    conv.id, conv.source = sample_id(raw, row, source), source.name
    conv.path, conv.loc, conv.element = row.path, row.loc, row.element
    return pair


def parse_pair_item(raw: Optional[bytes], path: str, loc: int, source: SourceConfig, roles: Dict[str, Role], *,
                    limit: int = DEFAULT_MAX_ROW_BYTES, element: bool = False) -> Pair:
    """One raw line of a stream or a presharded part (None: longer than the row limit) -> Pair, or BadRow: the
    checks `sharegpt.parse_item` applies to a conversation line, with `pair_of` in place of `conversation_of`."""
    if raw is not None and len(raw) > limit:
        raw = None
    return pair_of(parse_row(path, None if element else loc, raw, loc if element else None, limit=limit), source,
                   roles)


def pair_row(pair: Pair) -> Dict[str, Any]:
    """A checked pair in the canonical form `dsrecipes shard` writes (`PAIR_ROW_FORMAT`): sharegpt columns, roles
    named by their `Role` value, so a part needs no column settings and its sample ids survive."""
    conv = pair.prompt
    row: Dict[str, Any] = {"id": conv.id, "conversations": [{"from": t.role.value, "value": t.content}
                                                            for t in conv.turns],
                           "chosen": {"from": Role.assistant.value, "value": pair.chosen},
                           "rejected": {"from": Role.assistant.value, "value": pair.rejected}}
    if conv.system is not None:
        row["system"] = conv.system
    if conv.tools is not None:
        row["tools"] = conv.tools
    if pair.margin is not None:
        row["margin"] = pair.margin
    return row


def _pair(raw: Dict[str, Any], source: SourceConfig, roles: Dict[str, Role]) -> Pair:
    cols = source.columns
    conv = prompt_conversation(raw, source, roles)
    chosen, rejected = (_answer(raw, side, source, roles) for side in (cols.chosen, cols.rejected))
    if chosen == rejected:
        raise BadRow(BadReason.identical_sides, "chosen and rejected are the same text")
    margin = raw.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin)):
        raise BadRow(BadReason.bad_value, f"margin must be a finite number, got {margin!r}")
    return Pair(conv, chosen, rejected, None if margin is None else float(margin))


def prompt_conversation(raw: Dict[str, Any], source: SourceConfig, roles: Dict[str, Role]) -> Conversation:
    """The prompt turns of a row (ending with the turn a reply answers), its system prompt and tools: the prompt of
    a pair, and a prompt row (`rows=prompt`, sources/prompts.py)."""
    cols = source.columns
    prompt_col = cols.prompt if source.format is DatasetFormat.openai else cols.messages
    if prompt_col not in raw:
        raise BadRow(BadReason.missing_conversation, f"no {prompt_col!r} field (keys: {sorted(raw)[:8]})")
    turns = _message_turns({cols.messages: raw[prompt_col]}, source, roles)
    system = _optional_text(raw, cols.system)
    while turns and turns[0].role is Role.system:
        system = turns[0].content if system is None else f"{system}\n\n{turns[0].content}"
        turns = turns[1:]
    if not turns or any(t.role is Role.system for t in turns):
        raise BadRow(BadReason.system_not_first if turns else BadReason.empty_conversation,
                     "a system turn after the first user/assistant turn" if turns else "the prompt has no turns")
    if turns[-1].role in TRAINED_ROLES:
        raise BadRow(BadReason.bad_value, f"the prompt ends with a {turns[-1].role.value} turn; it must end with "
                                          "the turn the answers reply to")
    return Conversation("", turns, system, _tools_text(raw.get(cols.tools)))


def _answer(raw: Dict[str, Any], side: str, source: SourceConfig, roles: Dict[str, Role]) -> str:
    value: Optional[Any] = raw.get(side)
    if value is None:
        raise BadRow(BadReason.missing_side, f"no {side!r} answer")
    messages = value if isinstance(value, list) else [value]
    turns: List[Turn] = _message_turns({source.columns.messages: messages}, source, roles) if messages else []
    if len(turns) != 1 or turns[0].role is not Role.assistant:
        got = [t.role.value for t in turns]
        raise BadRow(BadReason.side_not_assistant, f"{side!r} must be one assistant message, got roles {got}")
    if not turns[0].content.strip():
        raise BadRow(BadReason.empty_answer, f"{side!r} has no text")
    return turns[0].content
