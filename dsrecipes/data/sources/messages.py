"""A Conversation as chat messages (the `messages` / `tools` that `tokenizer.apply_chat_template` takes), and the one
canonical text of tools and tool calls that every built-in template trains on.

Why canonical text: a served model gets tools and tool calls as structured data (`tools=[{...}]`, an assistant
message with `tool_calls`), and its chat template serialises them with `tojson` (transformers: `json.dumps(x,
ensure_ascii=False)`). Training renders the same serialisation, so the exported Jinja template (data/render/jinja.py)
reproduces the training text byte for byte. Where a row's text is not such JSON (tools that are not a list of
objects, a tool call that is not exactly `{"name": str, "arguments": JSON}`), the raw text is kept and travels as text:
tools in the system prompt ("Tools: <text>"), such a call as a plain assistant reply (chatml then renders it without
the `<tool_call>` wrapper, exactly as the exported template renders an assistant message with that content).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

Messages = List[Dict[str, Any]]


def tools_schema(tools: Optional[str]) -> Optional[List[Dict[str, Any]]]:
    """The tools text as a JSON list of objects (function schemas), or None when it is not one."""
    if not tools:
        return None
    try:
        parsed = json.loads(tools)
    except (ValueError, RecursionError):  # not JSON (or nested too deep for Python)
        return None
    return parsed if isinstance(parsed, list) and parsed and all(isinstance(x, dict) for x in parsed) else None


def tools_text(tools: str) -> str:
    schema = tools_schema(tools)
    return tools if schema is None else json.dumps(schema, ensure_ascii=False)


def tool_call(content: str) -> Optional[Dict[str, Any]]:
    """A tool-call turn as `{"name", "arguments"}` when its text is exactly that JSON object, else None."""
    try:
        call = json.loads(content)
    except (ValueError, RecursionError):  # not JSON (or nested too deep for Python)
        return None
    if not (isinstance(call, dict) and set(call) == {"name", "arguments"} and isinstance(call["name"], str)):
        return None
    args = call["arguments"]
    if isinstance(args, str):  # OpenAI style: the arguments as JSON text
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # not JSON (or nested too deep for Python)
            return None
    return {"name": call["name"], "arguments": args}


def tool_call_text(content: str) -> str:
    call = tool_call(content)
    return content if call is None else json.dumps(call, ensure_ascii=False)


def system_with_tools(system: Optional[str], tools: Optional[str]) -> Optional[str]:
    """The system prompt with the tools appended as text ("Tools: ..."), the built-in templates' convention."""
    if not tools:
        return system
    block = f"Tools: {tools_text(tools)}"
    return f"{system}\n\n{block}" if system else block


def chat_messages(conv: Conversation, default_system: Optional[str] = None, *, structured_tools: bool = True,
                  structured_calls: bool = True) -> Tuple[Messages, Optional[List[Dict[str, Any]]]]:
    """(messages, tools) for `apply_chat_template`.

    `default_system` fills in a missing system prompt (template=tokenizer: the model's template does not know
    `template.default_system`). `structured_tools` / `structured_calls`: pass JSON tools as `tools=` and JSON tool
    calls as `tool_calls`; a chat template that never reads them gets them as text instead (system prompt /
    message content), so nothing of the row is silently dropped.
    """
    schema = tools_schema(conv.tools) if structured_tools else None
    as_text = bool(conv.tools) and schema is None
    # Tools given as text make up the system prompt when the sample has none (no default in front): a caller at
    # inference passes such a system message itself, and a template only adds its default when there is none.
    system = conv.system if conv.system is not None or as_text else default_system
    if as_text:
        system = system_with_tools(system, conv.tools)
    messages: Messages = [] if system is None else [{"role": "system", "content": system}]
    messages += [turn_message(t, structured_calls) for t in conv.turns]
    return messages, schema


def messages_for(conv: Conversation, chat_template: Any, default_system: Optional[str] = None,
                 ) -> Tuple[Messages, Optional[List[Dict[str, Any]]]]:
    """(messages, tools) for a given chat template, the same in training (template=tokenizer) and at inference."""
    return chat_messages(conv, default_system, structured_tools=template_reads(chat_template, "tools"),
                         structured_calls=template_reads(chat_template, "tool_calls"))


def turn_message(t: Turn, structured_calls: bool = True) -> Dict[str, Any]:
    if t.role is Role.tool_call:
        call = tool_call(t.content) if structured_calls else None
        if call is not None:
            return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
        return {"role": "assistant", "content": tool_call_text(t.content)}
    role = {Role.user: "user", Role.assistant: "assistant", Role.observation: "tool"}[t.role]
    return {"role": role, "content": t.content}


def template_reads(chat_template: Any, name: str) -> bool:
    """Whether a chat template's source mentions `name` (e.g. `tool_calls`, `tools`): one that never does cannot
    render such data, so it is given as text."""
    return name in (chat_template if isinstance(chat_template, str) else json.dumps(chat_template))
