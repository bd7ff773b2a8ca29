"""Render a Conversation as text segments, marking which segments carry labels.

Every renderer returns pieces `(text, turn)`: `turn` is the index of an assistant/tool-call turn for the part that
may be trained (the reply text plus its end-of-turn token), None for everything else (headers, user turns, system).
`render()` then applies `data.train_on`, so piece boundaries, and therefore tokenization, are the same for every
`train_on`; only labels differ. Adjacent untrained pieces are merged, so a prompt is tokenized as one string, the
way it is at inference.

Templates (`template.name`):
  chatml           <|im_start|>role\\ntext<|im_end|>\\n; tool calls as assistant `<tool_call>\\n{json}\\n</tool_call>`,
                   observations as role `tool`; tools go into the system turn as "Tools: <json>"
  llama3           <|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\ntext<|eot_id|>; observations
                   as role `ipython`
  vicuna           FastChat v1.1: "{system} USER: {q} ASSISTANT: {a}</s>USER: ..."; observations "OBSERVATION: ..."
  plain            "### Role: text" joined by `template.separator`; replies end with the tokenizer's eos token
  human_assistant  "\\n\\nHuman: q\\n\\nAssistant: a<eos>" (Anthropic HH style)
  tokenizer        the tokenizer's own chat_template; trained spans found by rendering prefixes (the text added by
                   the assistant message after the generation prompt, trailing whitespace excluded). A template
                   that rewrites earlier turns (not prefix-stable) makes the row bad (`template_error`).
The system prompt is the sample's (`system` field or leading system turn), else `template.default_system`
(vicuna: FastChat's own when both are missing); tools text is appended to it ("Tools: ...").
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from dsrecipes.config.schema import TemplateConfig, TemplateKind, TrainOn
from dsrecipes.data.badrows import BadReason, BadRow
from dsrecipes.data.sharegpt import Conversation, Role, Turn


class Segment(NamedTuple):
    text: str
    trained: bool
    closes_turn: bool  # the end of an assistant/tool-call reply: truncation cuts between turns at these points


Piece = Tuple[str, Optional[int]]  # (text, index of the assistant/tool-call turn it replies for, or None)

VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

# Strings a template emits that must be one token of the tokenizer (else it is the wrong tokenizer for it).
REQUIRED_TOKENS: Dict[TemplateKind, Tuple[str, ...]] = {
    TemplateKind.chatml: ("<|im_start|>", "<|im_end|>"),
    TemplateKind.llama3: ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    TemplateKind.vicuna: ("</s>",),
    TemplateKind.plain: (),
    TemplateKind.human_assistant: (),
    TemplateKind.tokenizer: (),
}


def system_text(conv: Conversation, cfg: TemplateConfig, fallback: Optional[str] = None) -> Optional[str]:
    system = conv.system if conv.system is not None else (cfg.default_system if cfg.default_system is not None else fallback)
    if conv.tools:
        block = f"Tools: {conv.tools}"
        system = f"{system}\n\n{block}" if system else block
    return system


def _chatml(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> List[Piece]:
    out: List[Piece] = []
    system = system_text(conv, cfg)
    if system is not None:
        out.append((f"<|im_start|>system\n{system}<|im_end|>\n", None))
    for i, t in enumerate(conv.turns):
        if t.role is Role.assistant:
            out += [("<|im_start|>assistant\n", None), (f"{t.content}<|im_end|>", i), ("\n", None)]
        elif t.role is Role.tool_call:
            out += [("<|im_start|>assistant\n", None), (f"<tool_call>\n{t.content}\n</tool_call><|im_end|>", i), ("\n", None)]
        else:
            name = "tool" if t.role is Role.observation else "user"
            out.append((f"<|im_start|>{name}\n{t.content}<|im_end|>\n", None))
    return out


def _llama3(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> List[Piece]:
    def header(role: str) -> str:
        return f"<|start_header_id|>{role}<|end_header_id|>\n\n"

    out: List[Piece] = [("<|begin_of_text|>", None)]
    system = system_text(conv, cfg)
    if system is not None:
        out.append((f"{header('system')}{system}<|eot_id|>", None))
    for i, t in enumerate(conv.turns):
        if t.role in (Role.assistant, Role.tool_call):
            out += [(header("assistant"), None), (f"{t.content}<|eot_id|>", i)]
        else:
            out.append((f"{header('ipython' if t.role is Role.observation else 'user')}{t.content}<|eot_id|>", None))
    return out


def _vicuna(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> List[Piece]:
    out: List[Piece] = [(f"{tokenizer.bos_token or ''}{system_text(conv, cfg, VICUNA_SYSTEM)} ", None)]
    for i, t in enumerate(conv.turns):
        if t.role in (Role.assistant, Role.tool_call):
            out += [("ASSISTANT: ", None), (f"{t.content}</s>", i)]
        else:
            out.append((f"{'OBSERVATION' if t.role is Role.observation else 'USER'}: {t.content} ", None))
    return out


_PLAIN_NAMES = {Role.user: "User", Role.observation: "Observation", Role.assistant: "Assistant", Role.tool_call: "Assistant"}


def _plain(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> List[Piece]:
    sep, eos = cfg.separator, tokenizer.eos_token or ""
    system = system_text(conv, cfg)
    out: List[Piece] = [] if system is None else [(f"### System: {system}{sep}", None)]
    for i, t in enumerate(conv.turns):
        if t.role in (Role.assistant, Role.tool_call):
            out += [("### Assistant: ", None), (f"{t.content}{eos}", i), (sep, None)]
        else:
            out.append((f"### {_PLAIN_NAMES[t.role]}: {t.content}{sep}", None))
    return out


def _human_assistant(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> List[Piece]:
    eos = tokenizer.eos_token or ""
    system = system_text(conv, cfg)
    out: List[Piece] = [] if system is None else [(system, None)]
    for i, t in enumerate(conv.turns):
        if t.role in (Role.assistant, Role.tool_call):
            out += [("\n\nAssistant: ", None), (f"{t.content}{eos}", i)]
        else:
            out.append((f"\n\n{'Observation' if t.role is Role.observation else 'Human'}: {t.content}", None))
    return out


def hf_messages(conv: Conversation, cfg: TemplateConfig) -> Tuple[List[Dict[str, Any]], Optional[list]]:
    """Conversation -> (messages, tools) for `tokenizer.apply_chat_template` (tool calls as `tool_calls`)."""
    tools = None
    system = conv.system if conv.system is not None else cfg.default_system
    if conv.tools:
        try:
            parsed = json.loads(conv.tools)
        except (ValueError, RecursionError):  # not JSON: kept as text
            parsed = None
        if isinstance(parsed, list) and all(isinstance(x, dict) for x in parsed):
            tools = parsed
        else:  # not a JSON list of schemas: keep the text in the system prompt
            system = f"{system}\n\nTools: {conv.tools}" if system else f"Tools: {conv.tools}"
    messages: List[Dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
    for t in conv.turns:
        messages.append(_hf_message(t))
    return messages, tools


def _hf_message(t: Turn) -> Dict[str, Any]:
    if t.role is Role.tool_call:
        try:
            call = json.loads(t.content)
        except (ValueError, RecursionError):
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            fn = {"name": call["name"], "arguments": call.get("arguments", {})}
            return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": fn}]}
        return {"role": "assistant", "content": t.content}
    role = {Role.user: "user", Role.assistant: "assistant", Role.observation: "tool"}[t.role]
    return {"role": role, "content": t.content}


def _tokenizer_template(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> List[Piece]:
    messages, tools = hf_messages(conv, cfg)
    offset = len(messages) - len(conv.turns)  # the system message, if any

    def apply(msgs: List[Dict[str, Any]], generation: bool) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=generation)
        except Exception as exc:  # jinja's TemplateError / raise_exception: this template refuses this row
            raise BadRow(BadReason.template_error, " ".join(str(exc).split())) from None

    full = apply(messages, False)
    out: List[Piece] = []
    pos = 0
    for i, t in enumerate(conv.turns):
        if t.role not in (Role.assistant, Role.tool_call):
            continue
        before = apply(messages[: offset + i], True)
        after = full if offset + i + 1 == len(messages) else apply(messages[: offset + i + 1], False)
        if not (full.startswith(after) and after.startswith(before) and len(before) >= pos):
            raise BadRow(BadReason.template_error, f"chat_template is not prefix-stable at turn {i}; use a built-in template")
        body = after[len(before):].rstrip()
        out += [(full[pos: len(before)], None), (body, i)]
        pos = len(before) + len(body)
    out.append((full[pos:], None))
    return out


RENDERERS: Dict[TemplateKind, Callable[[Conversation, TemplateConfig, Any], List[Piece]]] = {
    TemplateKind.chatml: _chatml,
    TemplateKind.llama3: _llama3,
    TemplateKind.vicuna: _vicuna,
    TemplateKind.plain: _plain,
    TemplateKind.human_assistant: _human_assistant,
    TemplateKind.tokenizer: _tokenizer_template,
}


def render(conv: Conversation, template_cfg: TemplateConfig, tokenizer: Any, train_on: TrainOn) -> List[Segment]:
    """Segments whose texts concatenate to the rendered conversation; `trained` marks label-carrying text."""
    pieces = RENDERERS[template_cfg.name](conv, template_cfg, tokenizer)
    last = len(conv.turns) - 1  # normalisation guarantees the final turn is an assistant/tool-call reply
    segments: List[Segment] = []
    prompt = ""
    for text, turn in pieces:
        if turn is None:
            prompt += text
            continue
        if prompt:
            segments.append(Segment(prompt, train_on is TrainOn.all, False))
            prompt = ""
        trained = train_on is not TrainOn.last_assistant or turn == last
        segments.append(Segment(text, trained, True))
    if prompt:
        segments.append(Segment(prompt, train_on is TrainOn.all, False))
    return segments


def generation_prompt(conv: Conversation, template_cfg: TemplateConfig, tokenizer: Any) -> str:
    """The text a model continues to answer `conv` (whose last turn is the user's): everything before the reply."""
    probe = Conversation(conv.id, list(conv.turns) + [Turn(Role.assistant, "")], conv.system, conv.tools)
    pieces = RENDERERS[template_cfg.name](probe, template_cfg, tokenizer)
    last = len(probe.turns) - 1
    text = ""
    for piece, turn in pieces:
        if turn == last:
            return text
        text += piece
    raise AssertionError("renderer emitted no reply piece")


def check_template(template_cfg: TemplateConfig, tokenizer: Any) -> List[str]:
    """Problems using `tokenizer` with this template (missing special tokens, no chat_template, no eos)."""
    name = template_cfg.name
    problems = []
    for token in REQUIRED_TOKENS[name]:
        if len(tokenizer(token, add_special_tokens=False)["input_ids"]) != 1:
            problems.append(f"template.name: {name.value} needs {token!r} as one token, this tokenizer splits it "
                            "(pick the template the model was trained with, e.g. template=tokenizer)")
    if name in (TemplateKind.plain, TemplateKind.human_assistant) and not tokenizer.eos_token:
        problems.append(f"template.name: {name.value} ends replies with the eos token, and this tokenizer has none")
    if name is TemplateKind.tokenizer and not getattr(tokenizer, "chat_template", None):
        problems.append("template.name: tokenizer, but this tokenizer has no chat_template; pick a built-in template")
    return problems
