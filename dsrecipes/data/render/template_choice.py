"""Which template a run uses when none is chosen (`template=auto`, the default), and a warning when the chosen one
renders differently from the model's own chat template.

`auto`: the embedded tiny model -> chatml (its bundled tokenizer renders chatml); a model at `model.path` -> its
tokenizer's own chat_template (`tokenizer`) when it ships one, else chatml when the tokenizer has chatml's special
tokens, else plain (text markers plus eos, valid for any tokenizer). The launching process decides once and writes
the concrete name into the run's config.yaml.

A built-in template on a model that ships its own chat template is legal (e.g. teaching a base model chatml), but
training and the model's usual inference prompt then differ. `template_warnings` renders two probe conversations
both ways and names the first difference; the common case, a default system prompt the model's template injects
when a conversation has none (SmolLM2, Qwen2.5), is recognised and quoted with the setting that keeps it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from dsrecipes.boundary.chat_sandbox import TemplateRaised
from dsrecipes.boundary.chat_sandbox import render as render_chat_template
from dsrecipes.core.schema import TemplateConfig, TemplateKind, TrainOn
from dsrecipes.data.render.template import REQUIRED_TOKENS, render
from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.messages import messages_for
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

_MARK = "DSRECIPESSYSTEMMARK"


def choose_template(cfg: TemplateConfig, tokenizer: Any, model_path: Optional[str]) -> TemplateConfig:
    """`cfg` with `auto` replaced by the concrete template for this model and tokenizer (others unchanged)."""
    if cfg.name is not TemplateKind.auto:
        return cfg
    if model_path is None:
        name = TemplateKind.chatml
    elif getattr(tokenizer, "chat_template", None):
        name = TemplateKind.tokenizer
    elif all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == 1 for t in REQUIRED_TOKENS[TemplateKind.chatml]):
        name = TemplateKind.chatml
    else:
        name = TemplateKind.plain
    return dataclasses.replace(cfg, name=name)


def template_warnings(cfg: TemplateConfig, tokenizer: Any) -> List[str]:
    """How a built-in template's rendering differs from the tokenizer's own chat template (empty: same, or nothing
    to compare with)."""
    own = getattr(tokenizer, "chat_template", None)
    if cfg.name in (TemplateKind.tokenizer, TemplateKind.auto) or not own:
        return []
    probes = [Conversation("probe", [Turn(Role.user, "Hi there"), Turn(Role.assistant, "Hello!")]),
              Conversation("probe", [Turn(Role.user, "Hi there"), Turn(Role.assistant, "Hello!")], system="Be brief.")]
    try:
        ours = [_ours(p, cfg, tokenizer) for p in probes]
        theirs = [_theirs(p, tokenizer) for p in probes]
    except (TemplateRaised, BadRow):  # a template that refuses the probe: nothing meaningful to compare
        return []
    if ours == theirs:
        return []
    head = (f"template.name: {cfg.name.value} renders conversations differently from this model's own chat_template, "
            "so training and the model's usual inference prompt differ")
    injected = _injected_default_system(probes[0], cfg, tokenizer, theirs[0])
    if injected is not None:
        return [f"{head}: the model's template adds a default system prompt when a conversation has none "
                f"({injected!r}), {cfg.name.value} leaves it out. Use template=tokenizer (template=auto picks it), "
                f"or keep {cfg.name.value} with template.default_system set to that text"]
    k = 0 if ours[0] != theirs[0] else 1
    at = next((i for i, (a, b) in enumerate(zip(ours[k], theirs[k])) if a != b), min(len(ours[k]), len(theirs[k])))
    return [f"{head}: at character {at}, {cfg.name.value} renders {ours[k][max(0, at - 20): at + 40]!r} where the "
            f"model's template renders {theirs[k][max(0, at - 20): at + 40]!r}. Use template=tokenizer (template=auto "
            "picks it) unless teaching the model a new format is the point"]


def _ours(conv: Conversation, cfg: TemplateConfig, tokenizer: Any) -> str:
    return "".join(seg.text for seg in render(conv, cfg, tokenizer, TrainOn.assistant))


def _theirs(conv: Conversation, tokenizer: Any) -> str:
    messages, tools = messages_for(conv, tokenizer.chat_template)
    return render_chat_template(tokenizer, messages, tools=tools)  # the sandbox: TemplateRefused past its budgets


def _injected_default_system(probe: Conversation, cfg: TemplateConfig, tokenizer: Any, theirs: str) -> Optional[str]:
    """The text X such that `cfg` with default_system=X renders `probe` as the model's template does, if any."""
    marked = _ours(Conversation(probe.id, probe.turns, _MARK), cfg, tokenizer)
    before, _, after = marked.partition(_MARK)
    if theirs.startswith(before) and theirs.endswith(after) and len(theirs) > len(before) + len(after):
        text = theirs[len(before): len(theirs) - len(after)]
        with_default = dataclasses.replace(cfg, default_system=text)
        return text if _ours(probe, with_default, tokenizer) == theirs else None
    return None
