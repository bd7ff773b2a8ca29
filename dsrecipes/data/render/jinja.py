"""The chat template an exported tokenizer carries: a Jinja rendering of exactly the template the model trained on.

A served model is prompted through `tokenizer.apply_chat_template` (transformers, vLLM, TGI, ...), so the export
must carry the training template, not whatever the base tokenizer shipped. Each built-in template is defined once,
as a `Spec` in data/render/template.py (the literal text around each kind of message); the training renderer and
`chat_template()` here are both made from it: the Jinja source has the run's settings baked in as literals: `template.default_system` (vicuna: FastChat's system prompt when none is set), `template.separator`,
and the tokenizer's bos/eos strings. It takes the standard inputs: `messages` (an optional leading `system`
message, then `user`, `assistant` (text and/or `tool_calls`) and `tool` messages), `tools` (a list of function
schemas) and `add_generation_prompt`. Tools and tool calls are serialised with `tojson`, the canonical form
data/sources/messages.py trains on. Other roles, or a system message after the first, raise an error: the model never saw
them. `template=tokenizer` keeps the model's own template; a configured `template.default_system` is put in front
of it, because training filled it in for conversations without a system prompt.

tests/test_chat_export.py checks, for every template, that `apply_chat_template` with this source is byte-identical
to data/render/template.py's rendering (and generation prompt) on conversations with systems, tools, tool calls,
observations, several turns, an opening assistant turn, and CJK text.
"""

from __future__ import annotations

from typing import Any, Optional

from dsrecipes.core.schema import TemplateConfig, TemplateKind
from dsrecipes.data.render.template import Spec, default_system, template_spec


def chat_template(cfg: TemplateConfig, tokenizer: Any) -> Optional[str]:
    """The Jinja source to export for this run's template (None: template=tokenizer on a tokenizer without one)."""
    if cfg.name is TemplateKind.tokenizer:
        own = tokenizer.chat_template
        if not isinstance(own, str) or cfg.default_system is None:  # None, or several named templates: as they are
            return own
        # Training gave the model's template a system message whenever a conversation had none.
        return ("{%- if not messages or messages[0]['role'] != 'system' -%}{%- set messages = "
                f"[{{'role': 'system', 'content': {lit(cfg.default_system)}}}] + messages -%}}{{%- endif -%}}" + own)
    return builtin_source(template_spec(cfg, tokenizer), default_system(cfg))


def builtin_source(spec: Spec, default_system: Optional[str]) -> str:
    s = {name: lit(value) for name, value in spec._asdict().items()}
    s["reply_close"] = lit(spec.reply_close + spec.reply_after)  # the prompt text after a reply: not trained, same text
    s["reply_open"] = lit(spec.reply_open + spec.reply_lead)  # a reply's opening; the generation prompt stops before
    s["generation_prompt"] = lit(spec.reply_open)  # the lead (the space after "ASSISTANT:"), which the model writes
    text = "(m['content'] or '')"
    call = ("(('{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' + (f['arguments'] if f['arguments'] is string"
            " else (f['arguments'] | tojson)) + '}'))")
    parts = [
        f"{{%- set ns = namespace(system={'none' if default_system is None else lit(default_system)}, first=0) -%}}",
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set ns.system = messages[0]['content'] -%}{%- set ns.first = 1 -%}{%- endif -%}",
        "{%- if tools -%}{%- set block = 'Tools: ' + (tools | tojson) -%}"
        "{%- set ns.system = (ns.system + '\\n\\n' + block) if ns.system else block -%}{%- endif -%}",
        f"{{{{- {s['begin']} -}}}}",
        f"{{%- if ns.system is not none -%}}{{{{- {s['system_open']} + ns.system + {s['system_close']} -}}}}"
        "{%- endif -%}",
        "{%- for m in messages[ns.first:] -%}",
        "{%- if m['role'] == 'assistant' -%}",
        f"{{%- if m['content'] or not m['tool_calls'] -%}}{{{{- {s['reply_open']} + {text} + {s['reply_close']} -}}}}"
        "{%- endif -%}",
        "{%- for tc in (m['tool_calls'] or []) -%}{%- set f = tc['function'] if tc['function'] is defined else tc -%}",
        f"{{{{- {s['reply_open']} + {s['call_open']} + {call} + {s['call_close']} + {s['reply_close']} -}}}}",
        "{%- endfor -%}",
        f"{{%- elif m['role'] == 'user' -%}}{{{{- {s['user_open']} + {text} + {s['user_close']} -}}}}",
        f"{{%- elif m['role'] == 'tool' -%}}{{{{- {s['tool_open']} + {text} + {s['tool_close']} -}}}}",
        "{%- else -%}{{- raise_exception('this model was trained on system (first only), user, assistant and tool "
        "messages, not ' + m['role'] + ' here') -}}{%- endif -%}",
        "{%- endfor -%}",
        f"{{%- if add_generation_prompt -%}}{{{{- {s['generation_prompt']} -}}}}{{%- endif -%}}",
    ]
    return "".join(parts)


def lit(text: str) -> str:
    """`text` as a Jinja string literal. Jinja decodes literals with Python's `unicode-escape` after turning
    non-ASCII into escapes, so backslash, quote and line breaks are escaped and everything else stays as it is."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r")
    return f"'{escaped}'"
