"""Rows that are one sample around a prompt (owner: data/sources/): what reading, checking and writing them shares,
for every such row kind (`objective.rows`: `pair`, preference.py; `prompt`, prompts.py).

A row kind of this family is a table entry, `SampleKind(check, columns)`: `check` turns a row's JSON object into the
kind's sample (or raises BadRow), `columns` gives the sample's canonical columns beside the prompt's. Everything else
is here, once:
- `SampleKind.of`: a row as read (files.RawRow) -> sample, or BadRow: the read error, `not_an_object`, `too_deep`,
  then `check`; the sample's prompt gets its id (`sample_id`), source and place (`file:line`);
- `SampleKind.parse_item`: one raw line of a stream or a presharded part (None: past the row limit) -> sample;
- `SampleKind.canonical`: the sample in the canonical form `dsrecipes shard` writes (sharegpt columns, roles by
  `Role` value, so a part needs no column settings and its sample ids survive): `canonical_row`, the one layout of
  every row kind's parts (a conversation is a prompt with no columns of its own);
- `prompt_conversation`: the prompt turns every such row holds, checked like SFT turns (TRL's standard rows: a
  plain-text openai `prompt` is one user turn).
Which kinds there are and what reads, checks and writes each: data/rowkinds.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, List, Optional, Sequence, Tuple, TypeVar

from dsrecipes.core.schema import DEFAULT_MAX_ROW_BYTES, DatasetFormat, SourceConfig
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

S = TypeVar("S")  # a sample: its `.prompt` is a Conversation (the prompt turns, id, where it was read)
Roles = Dict[str, Role]


@dataclass(frozen=True)
class SampleKind(Generic[S]):
    """One row kind whose sample holds a prompt: its own checks and its own canonical columns."""

    check: Callable[[Dict[str, Any], SourceConfig, Roles], S]  # the row's JSON object -> sample, or BadRow
    columns: Callable[[S], Dict[str, Any]]  # the sample's canonical columns beside the prompt's (None: left out)
    lead: Tuple[str, ...] = ()  # of those, the ones written right after the prompt's turns (the rest go last)

    def of(self, row: RawRow, source: SourceConfig, roles: Roles) -> S:
        """A row as read -> sample, or BadRow (the row's own problem)."""
        if row.error is not None:
            raise row.error
        raw = row.value
        if not isinstance(raw, dict):
            raise BadRow(BadReason.not_an_object, f"row is a {type(raw).__name__}")
        try:
            sample = self.check(raw, source, roles)
        except RecursionError:
            raise BadRow(BadReason.too_deep, "nested too deep to read") from None
        conv = sample.prompt  # type: ignore[attr-defined]
        conv.id, conv.source = sample_id(raw, row, source), source.name
        conv.path, conv.loc, conv.element = row.path, row.loc, row.element
        return sample

    def parse_item(self, raw: Optional[bytes], path: str, loc: int, source: SourceConfig, roles: Roles, *,
                   limit: int = DEFAULT_MAX_ROW_BYTES, element: bool = False) -> S:
        """One raw line of a stream or a presharded part (None: longer than the row limit) -> sample, or BadRow:
        the checks `sharegpt.parse_item` applies to a conversation line, with `of` in place of `conversation_of`."""
        if raw is not None and len(raw) > limit:
            raw = None
        return self.of(parse_row(path, None if element else loc, raw, loc if element else None, limit=limit),
                       source, roles)

    def canonical(self, sample: S) -> Dict[str, Any]:
        """The sample as `dsrecipes shard` writes it: the prompt's sharegpt columns, then the kind's own."""
        return canonical_row(sample.prompt, self.columns(sample), self.lead)  # type: ignore[attr-defined]


def canonical_row(conv: Conversation, own: Optional[Dict[str, Any]] = None, lead: Sequence[str] = ()
                  ) -> Dict[str, Any]:
    """A row as `dsrecipes shard` writes it, for every row kind: `id`, `conversations` ([{from: Role value, value}]),
    the kind's `own` columns named in `lead`, `system` and `tools` when set, then its other own columns (a column
    whose value is None is left out). A conversation (SFT row) is the prompt alone."""
    own = {key: value for key, value in (own or {}).items() if value is not None}
    row: Dict[str, Any] = {"id": conv.id, "conversations": [_turn(t) for t in conv.turns]}
    row.update((key, own[key]) for key in lead if key in own)
    row.update((key, value) for key, value in (("system", conv.system), ("tools", conv.tools)) if value is not None)
    row.update((key, value) for key, value in own.items() if key not in lead)
    return row


def _turn(t: Turn) -> Dict[str, Any]:
    """A turn of a canonical row; one that is context only (OpenAI's `"weight": 0`) keeps its weight."""
    turn: Dict[str, Any] = {"from": t.role.value, "value": t.content}
    return turn if t.trained else {**turn, "weight": 0}


def prompt_conversation(raw: Dict[str, Any], source: SourceConfig, roles: Roles) -> Conversation:
    """The prompt turns of a row (ending with the turn a reply answers), its system prompt and tools: the prompt of
    a pair, and a prompt row (`rows=prompt`)."""
    cols = source.columns
    turns = _prompt_turns(raw, source, roles)
    system = _optional_text(raw, cols.system)
    while turns and turns[0].role is Role.system:
        system = turns[0].content if system is None else f"{system}\n\n{turns[0].content}"
        turns = turns[1:]
    if not turns or any(t.role is Role.system for t in turns):
        raise BadRow(BadReason.system_not_first if turns else BadReason.empty_conversation,
                     "a system turn after the first user/assistant turn" if turns else "the prompt has no turns")
    if turns[-1].role in TRAINED_ROLES:
        raise BadRow(BadReason.bad_value, f"the prompt's last turn is the model's ({turns[-1].role.value}): a "
                                          "prompt ends with the turn a reply answers (user or tool output), "
                                          "without its answer")
    return Conversation("", turns, system, _tools_text(raw.get(cols.tools)))


def _prompt_turns(raw: Dict[str, Any], source: SourceConfig, roles: Roles) -> List[Turn]:
    """The prompt's turns as written: a message list (ShareGPT `conversations`, openai/TRL `prompt`), or TRL's
    standard (plain-text) `prompt`, a string: one user turn, rendered with the template like every other prompt."""
    cols = source.columns
    openai = source.format is DatasetFormat.openai
    col = cols.prompt if openai else cols.messages
    if col not in raw:
        raise BadRow(BadReason.missing_conversation, f"no {col!r} field (keys: {sorted(raw)[:8]})")
    value = raw[col]
    if openai and isinstance(value, str):
        return [Turn(Role.user, value)]
    if not isinstance(value, list):
        read = "a message list or a string" if openai else "a message list"
        raise BadRow(BadReason.conversation_not_list, f"{col!r} is a {type(value).__name__}; it is read as {read}")
    if not value:
        raise BadRow(BadReason.empty_conversation, f"{col!r} is empty")
    return _message_turns({cols.messages: value}, source, roles)
