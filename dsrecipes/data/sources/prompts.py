"""Prompt rows -> checked prompts (a prompt conversation and an optional reference answer), for `objective.rows=prompt`.

Online objectives (`objective=grpo`) read prompts only: the completions are sampled by the policy during training.
Formats (per source, `format`):
- `sharegpt`: `conversations` holds the prompt turns, ending with a user (or tool output) turn; `system` / `tools`
  as for SFT rows.
- `openai`: `prompt` (TRL's column; a `messages` list is read when there is no `prompt`) is a message list ending
  with a user turn; a system message opening it is its system prompt. TRL's standard (plain-text) prompt, a string,
  is one user turn, rendered with the template like every other prompt.
The reference answer (what the built-in reward checks compare with, objectives/rewards.py) is the row's
`reference` field, else its `answer`, else its `solution` (TRL's accuracy_reward column): a string or a number
(kept as text), absent or null for none.

Every malformed row is a bad row (counted by reason, `file:line`, quarantined or fatal per `dataset.bad_rows`): the
checks of a pair's prompt (`samples.prompt_conversation`), plus `bad_value` for a reference that is not text or a
number. `prompt_too_long` is decided after tokenization (data/render/prompt_encode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from dsrecipes.core.schema import DatasetFormat, SourceConfig
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.samples import SampleKind, prompt_conversation
from dsrecipes.data.sources.sharegpt import REFERENCE_COLUMNS, Conversation, Role


@dataclass
class Prompt:
    prompt: Conversation  # the prompt turns, system, tools, id and where it was read
    reference: Optional[str]


def _prompt(raw: Dict[str, Any], source: SourceConfig, roles: Dict[str, Role]) -> Prompt:
    if source.format is DatasetFormat.openai and source.columns.prompt not in raw \
            and isinstance(raw.get(source.columns.messages), list):
        raw = {**raw, source.columns.prompt: raw[source.columns.messages]}
    return Prompt(prompt_conversation(raw, source, roles), _reference(raw))


def _reference(raw: Dict[str, Any]) -> Optional[str]:
    for key in REFERENCE_COLUMNS:
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise BadRow(BadReason.bad_value, f"{key!r} must be a string or a number, got {type(value).__name__}")
        return str(value)
    return None


PROMPTS: SampleKind[Prompt] = SampleKind(_prompt, lambda prompt: {"reference": prompt.reference})
prompt_of = PROMPTS.of  # a row as read -> Prompt, or BadRow
parse_prompt_item = PROMPTS.parse_item  # one raw line of a stream or a presharded part -> Prompt, or BadRow
prompt_row = PROMPTS.canonical  # a checked prompt as `dsrecipes shard` writes it (`PROMPT_ROW_FORMAT`)
