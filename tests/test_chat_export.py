"""The exported chat template is the training template: for every template option, a tokenizer saved with
data/render/jinja.py's source renders (through stock `apply_chat_template`, after a save/load round trip) byte for byte what
data/render/template.py trains on, and the generation prompt the model was trained to answer after."""

from __future__ import annotations

import json
from typing import List

import pytest

from dsrecipes.core.schema import TemplateConfig, TemplateKind, TrainOn
from dsrecipes.data.render.jinja import chat_template, lit
from dsrecipes.data.render.template import generation_prompt, render
from dsrecipes.data.sources.messages import messages_for
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

NASTY = "He said \"hi\" & 'bye' \\ {{ x }} {% y %} #}\n\r\t 中文 😀 \\n"
TOOLS = json.dumps([{"name": "get_weather", "description": "天气 lookup",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}], ensure_ascii=False)
CALL = json.dumps({"name": "get_weather", "arguments": {"city": "Zürich"}}, ensure_ascii=False)

U, A, C, OBS = Role.user, Role.assistant, Role.tool_call, Role.observation


def conv(turns, system=None, tools=None, cid="c") -> Conversation:
    return Conversation(cid, [Turn(r, t) for r, t in turns], system, tools)


CONVERSATIONS: List[Conversation] = [
    conv([(U, "What is 2 + 2?"), (A, "4")]),
    conv([(U, "Hi"), (A, "Hello! How can I help?"), (U, "Tell me a joke."), (A, "Why did the chicken...")],
         system="You are terse."),
    conv([(U, "Weather in Zürich?"), (C, CALL), (OBS, '{"temp_c": 21}'), (A, "It is 21 °C.")], tools=TOOLS),
    conv([(U, "Weather?"), (C, '{"arguments": {"city": "Bern"}, "name": "get_weather"}'), (OBS, "sunny"), (A, "Sunny.")],
         system="Use tools.", tools=TOOLS),  # key order differs: trained in canonical order
    conv([(U, "Both?"), (C, CALL), (C, json.dumps({"name": "get_weather", "arguments": "{\"city\": \"Bern\"}"})),
          (OBS, "21"), (OBS, "18"), (A, "21 and 18.")], tools=TOOLS),  # two calls in a row; arguments as JSON text
    conv([(A, "Welcome! Ask me anything."), (U, "你好，今天天气怎么样？"), (A, "今天天气晴朗。")]),  # opens with the assistant
    conv([(U, "用中文回答：一加一等于几？"), (A, "一加一等于二。")], system="你是一个乐于助人的助手。"),
    conv([(U, "List tools"), (A, "none")], tools="search(query): web search"),  # tools as text, not JSON
    conv([(U, "Call it"), (C, "<functioncall> search('x')"), (OBS, "found"), (A, "Done.")]),  # a call that is not JSON
    conv([(U, "Empty system"), (A, "ok\n\nwith  spaces  ")], system=""),
    conv([(U, "   "), (A, "")]),
]

SETTINGS = [
    (TemplateKind.chatml, None), (TemplateKind.chatml, NASTY),
    (TemplateKind.llama3, None), (TemplateKind.llama3, "Be helpful."),
    (TemplateKind.vicuna, None), (TemplateKind.vicuna, NASTY),
    (TemplateKind.plain, None), (TemplateKind.plain, "sys"),
    (TemplateKind.human_assistant, None), (TemplateKind.human_assistant, NASTY),
    (TemplateKind.tokenizer, None), (TemplateKind.tokenizer, NASTY),
]


@pytest.fixture(scope="module")
def tok():
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer

    return load_tokenizer(compose_and_load([]))


def exported(tok, cfg: TemplateConfig, tmp_path):
    """The tokenizer as an export writes it: the training template's Jinja source, saved and loaded again."""
    from transformers import AutoTokenizer

    tok = tok.__class__.from_pretrained(tok.name_or_path)
    tok.chat_template = chat_template(cfg, tok)
    tok.save_pretrained(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind,default_system", SETTINGS, ids=[f"{k.value}-{d is not None}" for k, d in SETTINGS])
def test_exported_template_renders_exactly_the_training_text(tok, tmp_path, kind, default_system):
    cfg = TemplateConfig(name=kind, separator="\n\n", default_system=default_system)
    served = exported(tok, cfg, tmp_path)
    for c in CONVERSATIONS:
        trained = "".join(seg.text for seg in render(c, cfg, tok, TrainOn.assistant))
        messages, tools = messages_for(c, served.chat_template)  # what a caller at inference passes
        assert served.apply_chat_template(messages, tools=tools, tokenize=False) == trained, c.turns
        # The generation prompt after each user/observation turn that a reply follows.
        for k in range(1, len(c.turns)):
            if c.turns[k].role in (A, C) and c.turns[k - 1].role in (U, OBS):
                prefix = Conversation(c.id, c.turns[:k], c.system, c.tools)
                messages, tools = messages_for(prefix, served.chat_template)
                want = generation_prompt(prefix, cfg, tok)
                assert served.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=True) == want


def test_structured_tool_calls_from_a_client_render_as_trained(tok, tmp_path):
    """An OpenAI-style client: tool_calls with `function.arguments` as a JSON string, content None."""
    cfg = TemplateConfig(name=TemplateKind.chatml)
    served = exported(tok, cfg, tmp_path)
    client = [{"role": "user", "content": "Weather in Zürich?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
              {"role": "tool", "content": '{"temp_c": 21}'}]
    trained = "".join(s.text for s in render(CONVERSATIONS[2], cfg, tok, TrainOn.assistant))
    text = served.apply_chat_template(client, tools=json.loads(TOOLS), tokenize=False, add_generation_prompt=True)
    assert trained.startswith(text)


def test_unknown_roles_are_refused(tok, tmp_path):
    served = exported(tok, TemplateConfig(name=TemplateKind.llama3), tmp_path)
    with pytest.raises(Exception, match="trained on system"):
        served.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
                                   tokenize=False)


def test_jinja_literals_round_trip():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    for text in (NASTY, "", "'", "\\", "a\r\nb", "\x00\x1f", "\u2028", "}}{{"):
        assert env.from_string("{{ " + lit(text) + " }}").render() == text


def test_real_sharegpt_rows_render_identically(tok, tmp_path, glaive):
    """Glaive tool-calling rows (English and Chinese, bundled) under every template."""
    import gzip

    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.data.sources.sharegpt import normalize_row

    rows = []
    for name in ("glaive_toolcall_en_demo.json.gz", "glaive_toolcall_zh_demo.json.gz"):
        data = json.loads(gzip.decompress((glaive / name).read_bytes()))
        rows += [normalize_row(r, f"{name}:{i}", SourceConfig(name=name)) for i, r in enumerate(data[:40])]
    for kind, default_system in SETTINGS[::2]:
        cfg = TemplateConfig(name=kind, default_system=default_system)
        served = exported(tok, cfg, tmp_path / kind.value)
        for c in rows:
            messages, tools = messages_for(c, served.chat_template)
            trained = "".join(seg.text for seg in render(c, cfg, tok, TrainOn.assistant))
            assert served.apply_chat_template(messages, tools=tools, tokenize=False) == trained, c.id


EXPECTED_STOP = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "vicuna": "<|endoftext|>", "plain": "<|endoftext|>",
                 "human_assistant": "<|endoftext|>", "tokenizer": "<|im_end|>", "auto": "<|im_end|>"}


@pytest.mark.parametrize("kind", [k.value for k in TemplateKind])
def test_an_export_of_each_template_serves_it(tmp_path, kind):
    """The whole road: a run's config -> export.py (make_servable) -> a saved directory -> stock transformers. The
    exported tokenizer renders the training text byte for byte (default system prompt included), the generation
    config stops at the template's end-of-turn token, use_cache is on, and the caller's tokenizer is untouched."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.serving import run_template
    from dsrecipes.rank.export import export_initial

    cfg = compose_and_load(["debug=fast", f"template={kind}", "template.default_system='Be exact.'"])
    training = load_tokenizer(cfg)
    own = training.chat_template
    out = export_initial(cfg, training, tmp_path / "export")
    assert training.chat_template == own
    served, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    template = run_template(cfg, training)
    assert template.name is not TemplateKind.auto
    for c in CONVERSATIONS:
        messages, tools = messages_for(c, served.chat_template)
        trained = "".join(seg.text for seg in render(c, template, training, TrainOn.assistant))
        assert served.apply_chat_template(messages, tools=tools, tokenize=False) == trained, (kind, c.turns)
    if template.name is not TemplateKind.tokenizer:  # the model's own template has no default system prompt here
        assert "Be exact." in served.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False)
    stops = model.generation_config.eos_token_id
    stops = stops if isinstance(stops, list) else [stops]
    assert stops[0] == served.convert_tokens_to_ids(EXPECTED_STOP[kind]) and served.eos_token_id in stops
    assert model.config.use_cache and model.generation_config.use_cache
