"""Rows -> Conversations: map columns and role aliases, check every row, apply the bad-row policy per source.

Formats (`dataset.format` / `sources[i].format`): ShareGPT (`conversations: [{from, value}]`), OpenAI
(`messages: [{role, content}]`, assistant `tool_calls` and `tool` turns included) and Alpaca
(`instruction`/`input`/`output`, optional `history` pairs). Reading files: files.py; the bad-row policy:
badrows.py.

Sample ids: the row's id column when present, else `<file name>:<line>` (1-based line for JSONL, 0-based array
index for JSON). Copies made by a mixing weight > 1 get `@<copy>` appended (see prepare.py). Messages name rows by
`file:line`, or `file: element N (line L)` for JSON arrays.

Nothing is dropped silently: a bad row raises `DataError("file:line: reason")` (`dataset.bad_rows=error`) or is
counted by reason and written to `<run>/quarantine.jsonl` (`skip`); turns after the last assistant/tool-call turn
are dropped on purpose and counted per conversation (`Conversation.dropped_turns`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Dict, Iterator, List, Optional

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import DEFAULT_MAX_ROW_BYTES, DatasetConfig, DatasetFormat, PairsAs, RowKind, SourceConfig
from dsrecipes.data.rowkinds import ROW_KINDS
from dsrecipes.data.sources.badrows import BadReason, BadRow, BadRowReport
from dsrecipes.data.sources.files import RawRow, expand_paths, no_file, parse_row, read_rows, used_columns
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.row_shapes import other_format, other_keys, prompt_completion_messages
from dsrecipes.data.sources.split_shares import keeps


class Role(str, Enum):
    system = "system"
    user = "user"
    assistant = "assistant"
    tool_call = "tool_call"
    observation = "observation"


TRAINED_ROLES = (Role.assistant, Role.tool_call)

ROLE_ALIASES: Dict[str, Role] = {
    "human": Role.user, "user": Role.user,
    "gpt": Role.assistant, "assistant": Role.assistant, "bot": Role.assistant, "model": Role.assistant,
    "system": Role.system,
    "function_call": Role.tool_call, "tool_call": Role.tool_call,
    "observation": Role.observation, "tool": Role.observation, "function": Role.observation,
}


@dataclass(frozen=True)
class Turn:
    role: Role
    content: str
    trained: bool = True  # False: OpenAI's `"weight": 0` on an assistant message (context, never a label)


@dataclass
class Conversation:
    id: str
    turns: List[Turn]  # no system turns: the system prompt lives in `system`
    system: Optional[str] = None
    tools: Optional[str] = None
    source: str = ""  # name of the SourceConfig it came from (mixing weights)
    dropped_turns: int = 0  # trailing turns after the last assistant/tool-call turn, dropped on purpose
    path: str = ""  # where it was read (for messages about problems found later, e.g. by a template)
    loc: Optional[int] = 0  # the line where the row starts (None: a stream element whose line is looked up later)
    element: Optional[int] = None  # its index in a JSON array


# ----------------------------------------------------------------------------------------------------------------
# Rows -> Conversation


def conversation_dict(conv: Conversation) -> Dict[str, Any]:
    """A Conversation as plain JSON data (quarantine entries for rows a template refused)."""
    return {"id": conv.id, "system": conv.system, "tools": conv.tools,
            "turns": [{"role": t.role.value, "content": t.content} for t in conv.turns]}


def role_table(source: SourceConfig) -> Dict[str, Role]:
    """The alias table of a source: defaults plus `roles` (raw name -> canonical role name)."""
    table = dict(ROLE_ALIASES)
    for raw, canonical in source.roles.items():
        try:
            table[raw.strip().lower()] = Role(canonical)
        except ValueError:
            valid = ", ".join(r.value for r in Role)
            raise ConfigError(f"roles.{raw}: {canonical!r} is not a role; valid: {valid}") from None
    return table


def sample_id(raw: Any, row: RawRow, source: SourceConfig) -> str:
    if isinstance(raw, dict):
        value = raw.get(source.columns.id)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return str(value)
    return row.default_id


def normalize_row(raw: Any, sample_id: str, source: SourceConfig, roles: Optional[Dict[str, Role]] = None) -> Conversation:
    """One parsed row -> Conversation, or BadRow(reason). `roles` defaults to `role_table(source)`."""
    if not isinstance(raw, dict):
        raise BadRow(BadReason.not_an_object, f"row is a {type(raw).__name__}")
    cols = source.columns
    table = role_table(source) if roles is None else roles
    sides = _pair_advice(raw, source)
    if sides and source.pairs_as is PairsAs.chosen:
        if source.format is DatasetFormat.alpaca:  # the pair reader (objective=dpo) reads no alpaca pairs either
            raise BadRow(BadReason.preference_row, f"an alpaca pair ({cols.chosen!r}/{cols.rejected!r})", advice=(
                "dataset.pairs_as=chosen reads pairs in the sharegpt or openai format, as objective=dpo does"))
        return chosen_conversation(raw, sample_id, source, table)
    pair = sides or prompt_advice(raw, source, SFT_READS)  # a row of another kind: what reads it
    if sides and source.format is not DatasetFormat.alpaca and _holds_answer_turn(raw, source, table):
        # A pair whose prompt has earlier answers would train here on that history alone, its chosen/rejected
        # answers unread: refused as the pair it is (a single-turn pair already stops at no_assistant_turn below).
        held = [c for c in (cols.chosen, cols.rejected) if c in raw]
        raise BadRow(BadReason.preference_row, f"holds {held} beside its conversation", advice=sides)
    if source.format is DatasetFormat.alpaca:
        turns = _alpaca_turns(raw, source)
    else:
        try:
            turns = _message_turns(raw, source, table)
        except BadRow as bad:
            if pair and bad.reason is BadReason.missing_conversation:
                raise BadRow(bad.reason, bad.detail, advice=pair) from None
            raise
    system = _optional_text(raw, cols.system)
    tools = _tools_text(raw.get(cols.tools))
    # Leading system turns become the system prompt; a system turn later on is ambiguous, so it is a bad row.
    while turns and turns[0].role is Role.system:
        system = turns[0].content if system is None else f"{system}\n\n{turns[0].content}"
        turns = turns[1:]
    if any(t.role is Role.system for t in turns):
        raise BadRow(BadReason.system_not_first, "a system turn after the first user/assistant turn")
    last = max((i for i, t in enumerate(turns) if t.role in TRAINED_ROLES), default=-1)
    if last < 0:
        raise BadRow(BadReason.no_assistant_turn, f"roles: {[t.role.value for t in turns]}", advice=pair)
    return Conversation(sample_id, turns[: last + 1], system, tools, source.name, len(turns) - last - 1)


def chosen_conversation(raw: Dict[str, Any], sample_id: str, source: SourceConfig, roles: Dict[str, Role]
                        ) -> Conversation:
    """A pair row read by SFT under `dataset.pairs_as=chosen` (DeepSpeed-Chat's step 1): its prompt turns + the chosen
    answer, trained like any assistant turn, after every check of the preference reader (preference.py, every format
    it reads; looked up in rowkinds.py because it imports this module). Its row id, hence its share, is unchanged."""
    pair = ROW_KINDS[RowKind.pair].sample_kind().check(raw, source, roles)
    prompt = pair.prompt
    return Conversation(sample_id, prompt.turns + [Turn(Role.assistant, pair.chosen)], prompt.system, prompt.tools,
                        source.name)


# a prompt row's reference answer: the first present (and not null); `solution` is the column TRL's GRPO reward
# functions read (trl.rewards.accuracy_reward(completions, solution))
REFERENCE_COLUMNS = ("reference", "answer", "solution")
SFT_READS = "objective=sft trains on conversations that end with the model's answer"


def prompt_advice(raw: Dict[str, Any], source: SourceConfig, reads: str) -> str:
    """What reads the row where it holds a reference answer and no answer turn (the reader found none): a prompt row
    of online RL (dataset=sample_prompts), which SFT would quarantine row by row. `reads`: what the objective that
    refused it reads. Decided on the row's keys, as `_pair_advice`, never on its text."""
    held = [key for key in REFERENCE_COLUMNS if raw.get(key) is not None]
    if not held or source.format is DatasetFormat.alpaca:  # an alpaca row's columns are its own mapping
        return ""
    return (f"this looks like a prompt row for online RL (a prompt and its {held[0]!r} answer, no answer turn): "
            f"{reads}; objective=grpo reads prompt rows and samples the answers (see dataset=sample_prompts and "
            "README \"Online RL (GRPO) on prompts\")")


def _holds_answer_turn(raw: Dict[str, Any], source: SourceConfig, roles: Dict[str, Role]) -> bool:
    """The row's conversation reads (the checks of `_message_turns`) and has an assistant turn."""
    try:
        return any(t.role in TRAINED_ROLES for t in _message_turns(raw, source, roles))
    except BadRow:
        return False  # its own problem is named by the reader


def _pair_advice(raw: Dict[str, Any], source: SourceConfig) -> str:
    """What reads the row where it holds a preference pair's answers (its conversation is then the prompt alone)."""
    if source.columns.chosen not in raw and source.columns.rejected not in raw:
        return ""
    return (f"this looks like a preference pair ({source.columns.chosen!r}/{source.columns.rejected!r}): objective=sft "
            "trains on conversations that end with the model's answer; train on pairs with objective=dpo or "
            "objective=reward (see dataset=sample_pairs and README \"Preference tuning (DPO)\"), or SFT on each "
            "pair's prompt + chosen answer (DeepSpeed-Chat's step 1) with dataset.pairs_as=chosen")


def conversation_of(row: RawRow, source: SourceConfig, roles: Dict[str, Role]) -> Conversation:
    """A row as read (files.RawRow) -> Conversation, or BadRow: the checks every reader of rows applies (map
    preparation, the stream pre-scan, `dsrecipes shard` and the loader workers of streams)."""
    if row.error is not None:
        raise row.error
    try:
        conv = normalize_row(row.value, sample_id(row.value, row, source), source, roles)
    except RecursionError:
        raise BadRow(BadReason.too_deep, "nested too deep to read") from None
    conv.path, conv.loc, conv.element = row.path, row.loc, row.element
    return conv


def parse_item(raw: Optional[bytes], path: str, loc: int, source: SourceConfig, roles: Dict[str, Role], *,
               limit: int = DEFAULT_MAX_ROW_BYTES, element: bool = False) -> Conversation:
    """One raw line of a stream (None: longer than the row limit) -> Conversation, or BadRow: `files.parse_row`
    and `conversation_of`, the checks of every reader. `element`: `loc` is a JSON array's element, not a line."""

    if raw is not None and len(raw) > limit:
        raw = None
    return conversation_of(parse_row(path, None if element else loc, raw, loc if element else None, limit=limit),
                           source, roles)


def _message_turns(raw: Dict[str, Any], source: SourceConfig, table: Dict[str, Role]) -> List[Turn]:
    cols = source.columns
    messages = raw[cols.messages] if cols.messages in raw else prompt_completion_messages(raw, source)
    if messages is None:
        raise BadRow(BadReason.missing_conversation, f"no {cols.messages!r} field (keys: {sorted(raw)[:8]})"
                     f"{other_format(raw)}")
    if not isinstance(messages, list):
        raise BadRow(BadReason.conversation_not_list, f"{cols.messages!r} is a {type(messages).__name__}")
    if not messages:
        raise BadRow(BadReason.empty_conversation, f"{cols.messages!r} is empty")
    turns: List[Turn] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRow(BadReason.turn_not_object, f"turn {i} is a {type(msg).__name__}")
        name = msg.get(cols.role)
        role = table.get(name.strip().lower()) if isinstance(name, str) else None
        if role is None:
            raise BadRow(BadReason.unknown_role, f"turn {i}: {cols.role}={name!r}" if cols.role in msg else
                         f"turn {i}: no {cols.role!r} key (keys: {sorted(msg)[:6]}){other_keys(msg)}")
        tool_calls = msg.get("tool_calls") if source.format is DatasetFormat.openai else None
        content = _content_text(msg.get(cols.content), allow_none=bool(tool_calls))
        if content is None and not tool_calls:
            raise BadRow(BadReason.bad_value, f"turn {i}: {cols.content!r} is missing or not a string")
        trained = _weight(msg, i)  # openai rows, and the canonical rows `dsrecipes shard` writes (samples.py)
        if content or not tool_calls:  # an assistant message holding only tool calls has no text turn
            turns.append(Turn(role, content, trained))
        if tool_calls:
            turns += [Turn(Role.tool_call, _tool_call_text(tc, i), trained) for tc in tool_calls]
    return turns


def _weight(msg: Dict[str, Any], turn: int) -> bool:
    """OpenAI's fine-tuning `weight` of a message: 1 (or none) trains an assistant message, 0 keeps it as context."""
    weight = msg.get("weight", 1)
    if type(weight) is not int or weight not in (0, 1):
        raise BadRow(BadReason.bad_value, f"turn {turn}: 'weight' must be 0 or 1, got {weight!r}")
    return weight == 1


def _content_text(value: Any, allow_none: bool) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        texts = [p.get("text") for p in value]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)  # OpenAI content parts, text only
    if value is None and allow_none:
        return ""
    return None


def _tool_call_text(call: Any, turn: int) -> str:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRow(BadReason.bad_value, f"turn {turn}: tool_calls entry without a function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # not JSON (or a 5000-digit number, nested too deep): kept as text
            pass
    return json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)


def _alpaca_turns(raw: Dict[str, Any], source: SourceConfig) -> List[Turn]:
    cols = source.columns
    for key in (cols.instruction, cols.output):
        if key not in raw:
            raise BadRow(BadReason.missing_field, f"no {key!r} field")
    instruction, output = raw[cols.instruction], raw[cols.output]
    extra = raw.get(cols.input) or ""
    if not all(isinstance(v, str) for v in (instruction, output, extra)):
        raise BadRow(BadReason.bad_value, f"{cols.instruction}/{cols.input}/{cols.output} must be strings")
    turns: List[Turn] = []
    history = raw.get(cols.history) or []
    if not isinstance(history, list) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in history
    ):
        raise BadRow(BadReason.bad_value, f"{cols.history!r} must be a list of [prompt, response] pairs")
    for prompt, response in history:
        turns += [Turn(Role.user, prompt), Turn(Role.assistant, response)]
    user = "\n".join(t for t in (instruction, extra) if t)
    return turns + [Turn(Role.user, user), Turn(Role.assistant, output)]


def _optional_text(raw: Dict[str, Any], key: str) -> Optional[str]:
    value = raw.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise BadRow(BadReason.bad_value, f"{key!r} is a {type(value).__name__}, not a string")
    return value


def _tools_text(value: Any) -> Optional[str]:
    """Tools as text for templates; empty lists ("[]", the Glaive convention for 'no tools') mean none."""
    if value is None:
        return None
    if not isinstance(value, str):
        if not isinstance(value, (list, dict)):
            raise BadRow(BadReason.bad_value, f"tools is a {type(value).__name__}")
        value = json.dumps(value, ensure_ascii=False)
    return None if value.strip() in ("", "[]", "{}") else value


# ----------------------------------------------------------------------------------------------------------------
# Sources


def iter_source(source: SourceConfig, report: BadRowReport, limit: Optional[int] = None,
                max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> Iterator[Conversation]:
    """Conversations of one source in file order; bad rows go to `report`; stops after `source.max_samples`
    (or `limit`, when smaller) good conversations without reading further."""
    for conv in iter_checked(source, report, limit, max_row_bytes, conversation_of):
        report.trailing_turns_dropped += conv.dropped_turns > 0
        yield conv


def iter_checked(source: SourceConfig, report: BadRowReport, limit: Optional[int], max_row_bytes: int,
                 check: Callable[[Any, SourceConfig, Any], Any]) -> Iterator[Any]:
    """`check(row, source, role_table)` of every row of one source in file order (conversations, preference
    pairs); a BadRow goes to `report`; stops after `source.max_samples` (or `limit`, when smaller) good rows."""
    table = role_table(source)
    caps = [c for c in (source.max_samples, limit) if c is not None]
    cap = min(caps) if caps else None
    files, missing = expand_paths(source.paths)
    for pattern in missing:
        report.rows_read += 1
        report.add(pattern, None, BadRow(BadReason.no_matching_path, f"source {source.name!r}: {no_file(pattern)}"))
    kept = 0
    for path in files:
        for row in read_rows(path, max_row_bytes, used_columns(source)):
            if cap is not None and kept >= cap:
                return
            if not keeps(row, source):  # another share's row (dataset.split)
                continue
            report.rows_read += 1
            try:
                item = check(row, source, table)
            except BadRow as bad:
                report.add(row.path, row.loc, bad, row.raw_text if row.error is not None else row.value, row.element)
                continue
            kept += 1
            yield item


def iter_conversations(dataset_cfg: DatasetConfig, *, report: BadRowReport,
                       sources: Optional[List[SourceConfig]] = None) -> Iterator[Conversation]:
    """All sources (`paths`, then `sources`, then registry `use` entries, unless resolved ones are given), in that
    fixed order. `dataset.max_samples` caps the total: reading stops after that many good conversations.
    """

    return iter_capped(dataset_cfg, resolve_sources(dataset_cfg) if sources is None else sources,
                       lambda source, limit: iter_source(source, report, limit, dataset_cfg.max_row_bytes))


def iter_capped(dataset_cfg: DatasetConfig, sources: List[SourceConfig],
                read: Callable[[SourceConfig, Optional[int]], Iterator[Any]]) -> Iterator[Any]:
    """`read(source, limit)` of every source in order (conversations, preference pairs), reading stopped after
    `dataset.max_samples` good rows over all of them (`limit`: what is left of it for this source)."""
    kept = 0
    for source in sources:
        limit = None if dataset_cfg.max_samples is None else dataset_cfg.max_samples - kept
        if limit is not None and limit <= 0:
            return
        for row in read(source, limit):
            kept += 1
            yield row
