"""Rows shaped as another tool writes them, for the conversation reader (sharegpt.py): TRL's prompt/completion rows
read as messages, and the advice for a row whose messages are not where the source looks.

TRL's SFT datasets come in four shapes; `dataset.format=openai` (dataset=openai_messages) reads three:
- conversational: `messages` (role/content) - the reader's own shape;
- conversational prompt/completion: `prompt` (a message list: system, user, earlier turns) and `completion` (a
  message list, the answer): the prompt's turns are context, the completion's assistant turns are trained, as TRL's
  completion-only loss trains them (an assistant turn inside the prompt gets OpenAI's `weight: 0`: context);
- standard prompt/completion: `prompt` and `completion` strings: one user turn and one assistant turn under the run's
  chat template (TRL joins the two texts without a template: a chat model fine-tuned here is served with its
  template, so it is trained with it);
- language modeling (`text` only) is not a conversation: the advice says so.
The prompt's column is `dataset.columns.prompt` (as for preference and prompt rows); `completion` is TRL's name.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsrecipes.core.schema import DatasetFormat, SourceConfig
from dsrecipes.data.sources.badrows import BadReason, BadRow

COMPLETION = "completion"  # TRL's column of the answer in prompt/completion rows


def prompt_completion_messages(raw: Dict[str, Any], source: SourceConfig) -> Optional[List[Dict[str, Any]]]:
    """The messages of a TRL prompt/completion row read as `dataset.format=openai` (see the module comment), None
    when the row is not one (no completion column, or another format); BadRow for a row of mixed or wrong types."""
    cols = source.columns
    if source.format is not DatasetFormat.openai or COMPLETION not in raw or cols.prompt not in raw:
        return None
    prompt, completion = raw[cols.prompt], raw[COMPLETION]
    if isinstance(prompt, str) and isinstance(completion, str):
        return [{cols.role: "user", cols.content: prompt}, {cols.role: "assistant", cols.content: completion}]
    if isinstance(prompt, list) and isinstance(completion, list) and completion:
        context = [_as_context(m, cols.role) for m in prompt]
        return context + completion
    raise BadRow(BadReason.bad_value, f"{cols.prompt!r}/{COMPLETION!r}: {type(prompt).__name__}/"
                 f"{type(completion).__name__}, not two strings (TRL standard) or two message lists (the completion "
                 "non-empty)")


def _as_context(message: Any, role_key: str) -> Any:
    """A prompt's message: an assistant turn in it is context (`weight: 0`), as in TRL's completion-only loss."""
    if isinstance(message, dict) and message.get(role_key) == "assistant" and "weight" not in message:
        return {**message, "weight": 0}
    return message


def other_format(raw: Dict[str, Any]) -> str:
    """What a row without the messages column looks like: an alpaca row, or chat messages under another column."""
    if "instruction" in raw and "output" in raw:
        return "; an alpaca row: read such files with dataset=alpaca (or dataset.format=alpaca)"
    if isinstance(raw.get("messages"), list):
        return "; chat messages under 'messages': dataset=openai_messages (or dataset.columns.messages=messages)"
    if isinstance(raw.get("conversations"), list):
        return "; ShareGPT rows under 'conversations': dataset=sharegpt_files (or dataset.columns.messages=conversations)"
    if "prompt" in raw and COMPLETION in raw:
        return "; TRL's prompt/completion rows: read them with dataset=openai_messages (or dataset.format=openai)"
    if "text" in raw:
        return "; a 'text' row (TRL's language modeling) is no conversation: make each text one assistant turn"
    return ""


def other_keys(msg: Dict[str, Any]) -> str:
    """A message in the other spelling: role/content (openai, TRL) in a ShareGPT reading, or from/value."""
    if "role" in msg and "content" in msg:
        return "; role/content messages: dataset=openai_messages (or dataset.columns.role=role dataset.columns.content=content)"
    if "from" in msg and "value" in msg:
        return "; from/value messages: dataset=sharegpt_files (or dataset.columns.role=from dataset.columns.content=value)"
    return ""
