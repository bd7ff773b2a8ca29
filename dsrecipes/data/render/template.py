"""Render a Conversation as text segments, marking which segments carry labels.

Every renderer returns pieces `(text, turn)`: `turn` is the index of an assistant/tool-call turn for the part that
may be trained (the reply text plus its end-of-turn token), None for everything else (headers, user turns, system).
`render()` then applies `data.train_on`, so piece boundaries, and therefore tokenization, are the same for every
`train_on`; only labels differ. Adjacent untrained pieces are merged, so a prompt is tokenized as one string, the
way it is at inference.

Templates (`template.name`); each built-in one is defined once, as a `Spec` (`template_spec`: the literal text around
each kind of message), from which both `_builtin` here and the exported Jinja `chat_template` (data/render/jinja.py) are
made:
  chatml           <|im_start|>role\\ntext<|im_end|>\\n; tool calls as assistant `<tool_call>\\n{json}\\n</tool_call>`,
                   observations as role `tool` (as LLaMA-Factory's chatml; Qwen2.5's own template and LF's qwen:
                   a user turn <tool_response>, tools in Qwen's "# Tools" block); tools go into the system turn as
                   "Tools: <json>"
  llama3           <|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\ntext<|eot_id|>; observations
                   as role `ipython`
  vicuna           FastChat v1.1: "{system} USER: {q} ASSISTANT: {a}</s>USER: ..."; observations "OBSERVATION: ...";
                   `</s>` is the model's eos token, so replies end with the tokenizer's own eos (SmolLM2:
                   <|im_end|>, Qwen: <|endoftext|>), as LLaMA-Factory renders it; on Llama/Vicuna tokenizers: `</s>`
  plain            "### Role: text" joined by `template.separator`; replies end with the tokenizer's eos token
  human_assistant  "\\n\\nHuman: q\\n\\nAssistant: a<eos>" (Anthropic HH style)
  tokenizer        the tokenizer's own chat_template; trained spans found by rendering prefixes (the text added by
                   the assistant message after the generation prompt, trailing whitespace excluded). A template
                   that rewrites earlier turns (not prefix-stable) makes the row bad (`template_error`), and so
                   does one that refuses the row (e.g. "roles must alternate"), with the template's own message.
The system prompt is the sample's (`system` field or leading system turn), else `template.default_system`
(vicuna: FastChat's own when both are missing); tools text is appended to it ("Tools: ..."). Tools and tool calls
are rendered in their canonical JSON (data/sources/messages.py), so that data/render/jinja.py's export of each template renders
exactly these strings from structured `tools` / `tool_calls`.

A conversation may open with an assistant turn (a greeting before the first user message): every template trains
it like any other reply, after whatever the template puts first (system prompt, header).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from dsrecipes.boundary.chat_sandbox import TemplateRaised, TemplateRefused, render_chunk, render_many
from dsrecipes.boundary.chat_sandbox import render as render_chat_template
from dsrecipes.core.schema import TemplateConfig, TemplateKind, TrainOn
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.messages import (
    chat_messages,
    messages_for,
    system_with_tools,
    tool_call,
    tool_call_text,
    tools_schema,
)
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn


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
    TemplateKind.vicuna: (),  # its "</s>" is the tokenizer's eos token, whatever that is
    TemplateKind.plain: (),
    TemplateKind.human_assistant: (),
    TemplateKind.tokenizer: (),
    TemplateKind.auto: (),  # resolved to one of the above before rendering (data/render/template_choice.py)
}


# Templates whose replies end with "the model's eos token" (rendered as the tokenizer's own eos string).
EOS_TERMINATED = (TemplateKind.vicuna, TemplateKind.plain, TemplateKind.human_assistant)


def system_text(conv: Conversation, cfg: TemplateConfig, fallback: Optional[str] = None) -> Optional[str]:
    if conv.system is not None or (conv.tools and tools_schema(conv.tools) is None):
        system = conv.system  # tools as text make up the system prompt, no default in front (messages.py)
    else:
        system = cfg.default_system if cfg.default_system is not None else fallback
    return system_with_tools(system, conv.tools)


class Spec(NamedTuple):
    """A built-in template, defined once: the literal text around each kind of message. The training renderer
    (`_builtin`) and the exported Jinja `chat_template` (data/render/jinja.py `builtin_source`) are both made from it. A
    reply is `reply_open` (prompt) + `reply_lead` + text + `reply_close` (trained: the end-of-turn token) +
    `reply_after` (prompt; trained too under `template.train_eot_newline`)."""

    begin: str  # once, at the start
    system_open: str
    system_close: str
    user_open: str
    user_close: str
    tool_open: str  # an observation (role `tool`)
    tool_close: str
    reply_open: str  # also the generation prompt
    reply_close: str
    call_open: str = ""  # around a tool call's canonical JSON
    call_close: str = ""
    reply_after: str = ""
    reply_lead: str = ""  # trained text before the reply (the space after "ASSISTANT:"): the prompt ends at a word


def _llama3_header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def template_spec(cfg: TemplateConfig, tokenizer: Any) -> Spec:
    """The built-in template `cfg.name`, with the run's settings and the tokenizer's bos/eos filled in."""
    bos, eos, sep = tokenizer.bos_token or "", tokenizer.eos_token or "", cfg.separator
    specs: Dict[TemplateKind, Spec] = {
        TemplateKind.chatml: Spec("", "<|im_start|>system\n", "<|im_end|>\n", "<|im_start|>user\n", "<|im_end|>\n",
                                  "<|im_start|>tool\n", "<|im_end|>\n", "<|im_start|>assistant\n", "<|im_end|>",
                                  "<tool_call>\n", "\n</tool_call>", "\n"),
        TemplateKind.llama3: Spec("<|begin_of_text|>", _llama3_header("system"), "<|eot_id|>", _llama3_header("user"),
                                  "<|eot_id|>", _llama3_header("ipython"), "<|eot_id|>", _llama3_header("assistant"),
                                  "<|eot_id|>"),
        TemplateKind.vicuna: Spec(bos, "", " ", "USER: ", " ", "OBSERVATION: ", " ", "ASSISTANT:", eos,
                                  reply_lead=" "),
        TemplateKind.plain: Spec("", "### System: ", sep, "### User: ", sep, "### Observation: ", sep,
                                 "### Assistant:", eos, reply_after=sep, reply_lead=" "),
        TemplateKind.human_assistant: Spec("", "", "", "\n\nHuman: ", "", "\n\nObservation: ", "",
                                           "\n\nAssistant:", eos, reply_lead=" "),
    }
    spec = specs[cfg.name]
    if cfg.train_eot_newline:  # the text after the end-of-turn token is trained with it (TRL, LLaMA-Factory)
        spec = spec._replace(reply_close=spec.reply_close + spec.reply_after, reply_after="")
    return spec


def default_system(cfg: TemplateConfig) -> Optional[str]:
    """The system prompt of a conversation without one (vicuna: FastChat's own when none is set)."""
    if cfg.default_system is None and cfg.name is TemplateKind.vicuna:
        return VICUNA_SYSTEM
    return cfg.default_system


def _builtin(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> List[Piece]:
    spec = template_spec(cfg, tokenizer)
    out: List[Piece] = [(spec.begin, None)]
    system = system_text(conv, cfg, default_system(cfg))
    if system is not None:
        out.append((f"{spec.system_open}{system}{spec.system_close}", None))
    for i, t in enumerate(conv.turns):
        if t.role in (Role.assistant, Role.tool_call):
            out += [(spec.reply_open, None), (f"{spec.reply_lead}{_reply(t, spec)}{spec.reply_close}", i),
                    (spec.reply_after, None)]
        elif t.role is Role.observation:
            out.append((f"{spec.tool_open}{t.content}{spec.tool_close}", None))
        else:
            out.append((f"{spec.user_open}{t.content}{spec.user_close}", None))
    return [(text, turn) for text, turn in out if text or turn is not None]


def _reply(t: Turn, spec: Spec) -> str:
    """A reply's text; a tool call in its canonical JSON (messages.py) between the template's call markers, so the
    exported template renders the same from structured `tool_calls` (a call that is not JSON stays as written)."""
    if t.role is not Role.tool_call:
        return t.content
    call = tool_call_text(t.content)
    return f"{spec.call_open}{call}{spec.call_close}" if tool_call(t.content) is not None else call


def hf_messages(conv: Conversation, cfg: TemplateConfig) -> Tuple[List[Dict[str, Any]], Optional[list]]:
    """Conversation -> (messages, tools) for `tokenizer.apply_chat_template` (tool calls as `tool_calls`)."""
    return chat_messages(conv, cfg.default_system)


def tokenizer_messages(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> Tuple[List[Dict[str, Any]], Optional[list]]:
    """(messages, tools) as template=tokenizer gives them to the model's own chat_template, in training and at
    inference alike: JSON tools / tool calls as structured data only when the template reads them."""
    return messages_for(conv, tokenizer.chat_template, cfg.default_system)


_REPLY_MARK = "DSRECIPESREPLYMARK"


class _Plan(NamedTuple):
    """What the model's template renders of one conversation: (k, generation) for messages[:k], the full text first,
    then each reply's text before (with the generation prompt) and after."""

    messages: List[Dict[str, Any]]
    tools: Optional[list]
    offset: int  # messages before the first turn (the system message, if any)
    wanted: List[Tuple[int, bool]]

    def renders(self) -> List[Tuple[List[Dict[str, Any]], bool]]:
        return [(self.messages[:k], generation) for k, generation in self.wanted]


def _plan(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> _Plan:
    messages, tools = tokenizer_messages(conv, cfg, tokenizer)
    offset = len(messages) - len(conv.turns)
    wanted = [(len(messages), False)]
    for k in (offset + i for i, t in enumerate(conv.turns) if t.role in (Role.assistant, Role.tool_call)):
        wanted += [(k, True)] * (k > 0) + [(k + 1, False)] * (k + 1 < len(messages))
    return _Plan(messages, tools, offset, wanted)


def _apply(tokenizer: Any, renders: List[Tuple[List[Dict[str, Any]], bool]], tools: Optional[list]) -> List[str]:
    """Renders in one call to the sandbox: past a budget or reaching for internals is TemplateRefused, the whole
    run's message; the template refusing this row is its BadRow."""
    try:
        return render_many(tokenizer, renders, tools=tools)
    except TemplateRaised as exc:  # raise_exception, an undefined key: this template refuses this row
        raise BadRow(BadReason.template_error, exc.detail) from None


def _tokenizer_template(conv: Conversation, cfg: TemplateConfig, tokenizer: Any,
                        done: Optional[Tuple[_Plan, List[str]]] = None) -> List[Piece]:
    """Pieces of the model's own template; `done`: the plan and its texts, rendered already (render_batch)."""
    if done is None:
        plan = _plan(conv, cfg, tokenizer)
        done = plan, _apply(tokenizer, plan.renders(), plan.tools)
    plan, rendered = done
    texts = dict(zip(plan.wanted, rendered))
    full = texts[len(plan.messages), False]
    out: List[Piece] = []
    pos = 0
    for i, t in enumerate(conv.turns):
        if t.role not in (Role.assistant, Role.tool_call):
            continue
        k = plan.offset + i
        before = texts[k, True] if k > 0 else _opening_prompt(
            lambda m, g: _apply(tokenizer, [(m, g)], plan.tools)[0], plan.messages[0])
        after = texts[k + 1, False]
        if not (full.startswith(after) and after.startswith(before) and len(before) >= pos):
            raise BadRow(BadReason.template_error, f"chat_template is not prefix-stable at turn {i}; use a built-in template")
        body = after[len(before):]
        body = body if cfg.train_eot_newline else body.rstrip()
        out += [(full[pos: len(before)], None), (body, i)]
        pos = len(before) + len(body)
    out.append((full[pos:], None))
    return out


def _opening_prompt(apply: Callable[[List[Dict[str, Any]], bool], str], first: Dict[str, Any]) -> str:
    """What a template renders before a reply that opens the conversation (no system, no user turn before it).
    transformers refuses to render an empty conversation, so render the reply alone with a marker for its text and
    keep what precedes the marker (a default system prompt, the assistant header), as for any other reply."""
    text = apply([{"role": first["role"], "content": _REPLY_MARK}], False)
    if _REPLY_MARK not in text:
        raise BadRow(BadReason.template_error, "chat_template does not render a conversation that opens with an "
                     "assistant turn; drop that turn or use a built-in template")
    return text[: text.index(_REPLY_MARK)]


RENDERERS: Dict[TemplateKind, Callable[[Conversation, TemplateConfig, Any], List[Piece]]] = {
    TemplateKind.chatml: _builtin,
    TemplateKind.llama3: _builtin,
    TemplateKind.vicuna: _builtin,
    TemplateKind.plain: _builtin,
    TemplateKind.human_assistant: _builtin,
    TemplateKind.tokenizer: _tokenizer_template,
}


def render(conv: Conversation, template_cfg: TemplateConfig, tokenizer: Any, train_on: TrainOn) -> List[Segment]:
    """Segments whose texts concatenate to the rendered conversation; `trained` marks label-carrying text."""
    return _segments(conv, RENDERERS[template_cfg.name](conv, template_cfg, tokenizer), train_on)


def render_batch(convs: Sequence[Conversation], template_cfg: TemplateConfig, tokenizer: Any,
                 train_on: TrainOn) -> List[Union[List[Segment], Exception]]:
    """`render` of each conversation, or the exception it raised (the row's problem); the model's own template
    renders the whole batch in as few round trips to its sandbox as it allows (chat_sandbox.render_chunk). A
    TemplateRefused (the template's problem, not a row's) is raised."""
    if template_cfg.name is not TemplateKind.tokenizer:
        return [_attempt(render, conv, template_cfg, tokenizer, train_on) for conv in convs]
    plans = [_attempt(_plan, conv, template_cfg, tokenizer) for conv in convs]
    todo = [i for i, plan in enumerate(plans) if isinstance(plan, _Plan)]
    got = dict(zip(todo, render_chunk(tokenizer, [(plans[i].renders(), plans[i].tools) for i in todo])))
    out: List[Union[List[Segment], Exception]] = []
    for i, conv in enumerate(convs):
        texts = got.get(i)
        if isinstance(texts, TemplateRaised):
            out.append(BadRow(BadReason.template_error, texts.detail))
        elif texts is None:
            out.append(plans[i])
        else:
            out.append(_attempt(_segments_of_texts, conv, template_cfg, tokenizer, train_on, (plans[i], texts)))
    return out


def _segments_of_texts(conv: Conversation, cfg: TemplateConfig, tokenizer: Any, train_on: TrainOn,
                       done: Tuple[_Plan, List[str]]) -> List[Segment]:
    return _segments(conv, _tokenizer_template(conv, cfg, tokenizer, done), train_on)


def _attempt(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or the exception it raised; TemplateRefused is raised (no row's problem)."""
    try:
        return fn(*args)
    except TemplateRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - a template is code working on untrusted rows: the caller sorts it out
        return exc


def _segments(conv: Conversation, pieces: List[Piece], train_on: TrainOn) -> List[Segment]:
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
        trained = (train_on is not TrainOn.last_assistant or turn == last) and conv.turns[turn].trained
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
    if name in EOS_TERMINATED and not tokenizer.eos_token:
        problems.append(f"template.name: {name.value} ends replies with the eos token, and this tokenizer has none")
    if name is TemplateKind.tokenizer and not getattr(tokenizer, "chat_template", None):
        problems.append("template.name: tokenizer, but this tokenizer has no chat_template; pick a built-in template")
    elif name is TemplateKind.tokenizer:
        problems += _probe_chat_template(tokenizer)
    return problems


def _probe_chat_template(tokenizer: Any) -> List[str]:
    """The model's template rendered once, in the sandbox, on a plain exchange: one that loops, grows without end or
    reaches for Python internals is named here (also by `validate`), before any row is read."""
    try:
        render_chat_template(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    except TemplateRaised:  # it declines this exchange: rows say what it accepts
        return []
    except TemplateRefused as exc:
        return [f"template.name: tokenizer: {exc}"]
    return []
