"""Templates and label masks, token by token: decoding exactly the trained tokens gives back the assistant texts
(plus end-of-turn tokens) for every template, multi-turn, tool-call and Chinese rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.paths import SAMPLE_DATA_DIR, TINY_TOKENIZER_DIR
from dsrecipes.core.schema import BadRows, SourceConfig, TemplateConfig, TemplateKind, TrainConfig, TrainOn
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.template import generation_prompt, render
from dsrecipes.data.render.tokenize import Encoder
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn, iter_source

FIX = Path(__file__).parent / "fixtures" / "data"
END = {TemplateKind.auto: "<|im_end|>", TemplateKind.chatml: "<|im_end|>", TemplateKind.tokenizer: "<|im_end|>", TemplateKind.llama3: "<|eot_id|>",
       TemplateKind.vicuna: "<|endoftext|>", TemplateKind.plain: "<|endoftext|>", TemplateKind.human_assistant: "<|endoftext|>"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


def make_cfg(template: TemplateKind, train_on: TrainOn = TrainOn.assistant, cutoff_len: int = 16384) -> TrainConfig:
    cfg = TrainConfig()
    cfg.template = TemplateConfig(name=template)
    cfg.data.train_on = train_on
    cfg.data.cutoff_len = cutoff_len
    return cfg


def read(path: Path, limit: int | None = None) -> List[Conversation]:
    report = BadRowReport(BadRows.skip, 1.0)
    return list(iter_source(SourceConfig(name=path.name, paths=[str(path)], max_samples=limit), report))


def expected_reply(template: TemplateKind, turn: Turn) -> str:
    """What a trained span must decode to, written independently of the renderers."""
    if turn.role is Role.tool_call and template in (TemplateKind.auto, TemplateKind.chatml, TemplateKind.tokenizer):
        body = turn.content
        if template is TemplateKind.tokenizer:  # the jinja template re-serialises the call
            call = json.loads(turn.content)
            body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call><|im_end|>"
    # these templates' prompt ends at "ASSISTANT:" (the generation prompt, FastChat/HH style): the space is the
    # model's first token of the reply, as one text tokenizes it (" 29"), so it is trained with the reply
    lead = " " if template in (TemplateKind.vicuna, TemplateKind.plain, TemplateKind.human_assistant) else ""
    return lead + turn.content + END[template]


def trained_runs(labels: List[int]) -> List[range]:
    runs, start = [], None
    for i, label in enumerate(labels + [IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            runs.append(range(start, i))
            start = None
    return runs


def sample_convs() -> List[Conversation]:
    convs = read(SAMPLE_DATA_DIR / "train.jsonl", 400)
    assert any(c.tools for c in convs) and any(c.system for c in convs)
    assert any(len(c.turns) >= 6 for c in convs) and any("首都" in c.turns[0].content for c in convs)
    return convs + read(FIX / "array.json")


def check_masks(tok, template: TemplateKind, train_on: TrainOn, convs: List[Conversation]) -> None:
    encoder = Encoder(tok, make_cfg(template, train_on))
    examples = encoder.encode_batch(convs)
    for conv, ex in zip(convs, examples):
        assert ex is not None and not ex.truncated, conv.id
        assert all(lab in (IGNORE_INDEX, tid) for lab, tid in zip(ex.labels, ex.input_ids)), conv.id
        replies = [t for t in conv.turns if t.role in (Role.assistant, Role.tool_call)]
        runs = trained_runs(ex.labels)
        if train_on is TrainOn.all:
            assert len(runs) == 1 and runs[0] == range(len(ex.input_ids))
            continue
        if train_on is TrainOn.last_assistant:
            replies = replies[-1:]
        decoded = [tok.decode([ex.input_ids[i] for i in run], skip_special_tokens=False) for run in runs]
        assert decoded == [expected_reply(template, t) for t in replies], conv.id
        # the whole sequence is the rendered text (up to the final reply): nothing lost between segments
        text = "".join(s.text for s in render(conv, encoder.template, tok, train_on))
        full = tok.decode(ex.input_ids, skip_special_tokens=False)
        assert text.startswith(full) and full.endswith(expected_reply(template, conv.turns[-1]))


@pytest.mark.parametrize("template", list(TemplateKind))
@pytest.mark.parametrize("train_on", list(TrainOn))
def test_masks_on_sample_data(tok, template, train_on):
    check_masks(tok, template, train_on, sample_convs())


@pytest.mark.parametrize("template", list(TemplateKind))
def test_masks_on_real_glaive_files(tok, glaive, template):
    convs = read(glaive / "glaive_toolcall_en_demo.json.gz", 40) + read(glaive / "glaive_toolcall_zh_demo.json.gz", 40)
    assert any(t.role is Role.tool_call for c in convs for t in c.turns)
    check_masks(tok, template, TrainOn.assistant, convs)


def test_tokenizer_template_matches_chatml_on_the_tiny_tokenizer(tok):
    convs = sample_convs()
    a = Encoder(tok, make_cfg(TemplateKind.chatml)).encode_batch(convs)
    b = Encoder(tok, make_cfg(TemplateKind.tokenizer)).encode_batch(convs)
    assert [(x.input_ids, x.labels) for x in a] == [(y.input_ids, y.labels) for y in b]


def test_batched_backend_equals_tokenizer_call(tok):
    texts = ["<|im_start|>user\n法国的首都是哪里？<|im_end|>\n", "  two  spaces\tand 🙂", "12 + 9 = 21."]
    enc = Encoder(tok, make_cfg(TemplateKind.chatml))
    assert enc.encode_texts(texts) == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_generation_prompt(tok):
    conv = Conversation("x", [Turn(Role.user, "What is 7 + 8?")], system="Be brief.")
    prompt = generation_prompt(conv, TemplateConfig(name=TemplateKind.chatml), tok)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 + 8?<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 8?"}]
    assert prompt == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert generation_prompt(conv, TemplateConfig(name=TemplateKind.tokenizer), tok) == prompt
    plain = generation_prompt(conv, TemplateConfig(name=TemplateKind.plain, separator="\n"), tok)
    assert plain == "### System: Be brief.\n### User: What is 7 + 8?\n### Assistant:"  # the model writes the space


def test_default_system_and_vicuna_system():
    class Tok:
        bos_token, eos_token = None, "</s>"

    conv = Conversation("x", [Turn(Role.user, "q"), Turn(Role.assistant, "a")])
    text = "".join(s.text for s in render(conv, TemplateConfig(name=TemplateKind.vicuna), Tok(), TrainOn.assistant))
    assert text.startswith("A chat between a curious user") and text.endswith(" USER: q ASSISTANT: a</s>")
    cfg = TemplateConfig(name=TemplateKind.human_assistant, default_system="Sys")
    text = "".join(s.text for s in render(conv, cfg, Tok(), TrainOn.assistant))
    assert text == "Sys\n\nHuman: q\n\nAssistant: a</s>"


def test_template_needs_its_special_tokens():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    bare = PreTrainedTokenizerFast(tokenizer_object=raw)
    with pytest.raises(ConfigError) as err:
        Encoder(bare, make_cfg(TemplateKind.chatml))
    assert "template.name: chatml needs '<|im_start|>' as one token" in str(err.value)
    for kind, needle in ((TemplateKind.plain, "eos token"), (TemplateKind.tokenizer, "no chat_template")):
        with pytest.raises(ConfigError, match=needle):
            Encoder(bare, make_cfg(kind))


@pytest.mark.parametrize("template", list(TemplateKind))
def test_a_conversation_opening_with_the_assistant_is_trained_under_every_template(tok, template):
    """Same treatment everywhere: the opening reply is trained like any other (template=tokenizer used to call it
    'Cannot apply chat template to an empty conversation')."""
    conv = Conversation("a", [Turn(Role.assistant, "Welcome! Ask me anything."), Turn(Role.user, "2 + 2?"),
                              Turn(Role.assistant, "4")])
    ex = Encoder(tok, make_cfg(template)).encode(conv)
    runs = trained_runs(ex.labels)
    assert [tok.decode([ex.input_ids[i] for i in r]) for r in runs] == [expected_reply(template, t)
                                                                         for t in (conv.turns[0], conv.turns[2])]


def test_a_template_that_refuses_an_opening_reply_names_its_reason(tok):
    """Templates that insist on user/assistant alternation (Llama-2, Mistral) make such rows bad, in their words."""
    from dsrecipes.data.sources.badrows import BadReason, BadRow

    strict = tok.__class__.from_pretrained(str(TINY_TOKENIZER_DIR))
    strict.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                            "{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    conv = Conversation("a", [Turn(Role.assistant, "Hi"), Turn(Role.user, "q"), Turn(Role.assistant, "a")])
    with pytest.raises(BadRow) as info:
        Encoder(strict, make_cfg(TemplateKind.tokenizer)).encode(conv)
    assert info.value.reason is BadReason.template_error and "must alternate" in info.value.detail
