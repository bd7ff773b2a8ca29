"""Train/serve token parity: for every template, tokenizer and assistant turn, the ids training puts before a reply
equal the ids serving feeds the model for that prompt (the exported chat_template through `apply_chat_template`
with `add_generation_prompt=True`, tokenized as one text, as `dsrecipes chat` and plain `generate` do).

Tokenizers only: the tiny tokenizer and SmolLM2's. llama3 is not a template SmolLM2's tokenizer can use (its special
tokens are not in the vocabulary: check_template refuses it); with them added, its generation prompt ends in "\n\n",
which a GPT-2 pre-tokenizer cuts differently before a word than at the end of a text, so no single training sequence
can equal serving at every turn: that case is what inspect-data's parity line reports (tested here).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest

from dsrecipes.core.schema import TemplateKind, TrainOn
from dsrecipes.data.render.jinja import chat_template
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.template import hf_messages, tokenizer_messages
from dsrecipes.data.render.tokenize import Encoder
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

TEMPLATES = [k for k in TemplateKind if k is not TemplateKind.auto]
LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

U, A = Role.user, Role.assistant
CONVS = [
    Conversation("a", [Turn(U, "Is the sky green?"), Turn(A, "No, it is blue."), Turn(U, "And grass?"),
                       Turn(A, "Yes. Green."), Turn(U, "Thanks!"), Turn(A, "You are welcome.")], system="Be brief."),
    Conversation("b", [Turn(U, "2 + 2?"), Turn(A, "4"), Turn(U, "法国的首都?"), Turn(A, "巴黎。"),
                       Turn(U, "List two."), Turn(A, "- one\n- two")]),
    Conversation("c", [Turn(U, "Say hi"), Turn(A, "Hi!"), Turn(U, "Again, with code"),
                       Turn(A, "```python\nprint('hi')\n```"), Turn(U, "ok"), Turn(A, "...done")]),
]


@functools.lru_cache(maxsize=None)
def _tokenizer(which: str, smollm2_dir):
    from transformers import AutoTokenizer

    from dsrecipes.core.paths import ASSETS_DIR

    if which == "tiny":
        return AutoTokenizer.from_pretrained(ASSETS_DIR / "tiny_tokenizer")
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tokenizer(request):
    return _tokenizer(request.param, request.getfixturevalue("smollm2_dir"))


def _cfg(make_cfg, kind: TemplateKind, eot_newline: bool = False):
    cfg = make_cfg("data.cutoff_len=4096", check_files=False)
    template = replace(cfg.template, name=kind, train_eot_newline=eot_newline)
    return replace(cfg, template=template, data=replace(cfg.data, train_on=TrainOn.assistant))


def reply_starts(labels):
    """Token index where each trained run (one reply) starts."""
    return [i for i, x in enumerate(labels) if x != IGNORE_INDEX and (i == 0 or labels[i - 1] == IGNORE_INDEX)]


def serving_ids(tokenizer, cfg, conv: Conversation, turn: int):
    """What serving tokenizes for the reply at `turn`: the exported template's generation prompt, as one text."""
    served = copy.copy(tokenizer)
    served.chat_template = chat_template(cfg.template, tokenizer)
    history = Conversation(conv.id, conv.turns[:turn], conv.system)
    if cfg.template.name is TemplateKind.tokenizer:
        messages, tools = tokenizer_messages(history, cfg.template, tokenizer)
    else:
        messages, tools = hf_messages(history, cfg.template)
    text = served.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# train_eot_newline changes only the templates with text after the end-of-turn token
CASES = [(k, False) for k in TEMPLATES] + [(k, True) for k in (TemplateKind.chatml, TemplateKind.plain,
                                                                 TemplateKind.tokenizer)]


@pytest.mark.parametrize("kind,eot_newline", CASES)
def test_prompt_ids_of_every_turn_equal_serving(tokenizer, make_cfg, kind, eot_newline):
    if kind is TemplateKind.tokenizer and not tokenizer.chat_template:
        pytest.skip("this tokenizer has no chat_template")
    if kind is TemplateKind.llama3 and "<|eot_id|>" not in tokenizer.get_vocab():
        pytest.skip("check_template refuses llama3 on this tokenizer (see the module docstring)")
    cfg = _cfg(make_cfg, kind, eot_newline)
    encoder = Encoder(tokenizer, cfg)
    for conv in CONVS:
        ex = encoder.encode(conv)
        starts = reply_starts(ex.labels)
        turns = [i for i, t in enumerate(conv.turns) if t.role is Role.assistant]
        assert len(starts) == len(turns), conv.id
        served = [serving_ids(tokenizer, cfg, conv, turn) for turn in turns]
        for start, turn, ids in zip(starts, turns, served):
            assert ex.input_ids[:start] == ids, (conv.id, turn)
        # every trained token decodes to the reply text and its end-of-turn text, nothing of the prompt
        trained = tokenizer.decode([t for t, x in zip(ex.input_ids, ex.labels) if x != IGNORE_INDEX])
        for turn in turns:
            assert conv.turns[turn].content in trained
    assert encoder.full_text  # the one-text path (whole-conversation tokenization) serves this template


def test_eot_newline_option_trains_the_newline(make_cfg, smollm2_dir):
    """chatml: off, the `\\n` after <|im_end|> is context only (and the last one is not kept); on, it is trained,
    the last one included, as TRL and LLaMA-Factory train it."""
    tok = _tokenizer("smollm2", smollm2_dir)
    nl = tok("\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for on in (False, True):
        ex = Encoder(tok, _cfg(make_cfg, TemplateKind.chatml, on)).encode(CONVS[0])
        after_end = [(ex.input_ids[i + 1] if i + 1 < len(ex.input_ids) else None, ex.labels[i + 1]
                      if i + 1 < len(ex.labels) else None) for i, t in enumerate(ex.input_ids) if t == end
                     and ex.labels[i] != IGNORE_INDEX]
        assert len(after_end) == 3
        if on:
            assert after_end == [(nl[0], nl[0])] * 3
        else:
            assert after_end == [(nl[0], IGNORE_INDEX)] * 2 + [(None, None)]


def test_inspect_data_shows_the_parity_and_leaves_no_temp_dir(tmp_path, capsys, monkeypatch):
    """A successful call without --run-dir removes its statistics directory (issue 49), and prints, for the run's
    template, how many reply prompts serving tokenizes as training did."""
    import tempfile

    from dsrecipes import cli

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    argv = [f"data.cache_dir={tmp_path / 'cache'}", "dataset.max_samples=20", "dataset.val_size=0", "template=vicuna",
            "--rows", "0"]
    assert cli.main(["inspect-data", *argv]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("template vicuna: train/serve tokens:")]
    assert len(line) == 1 and "DIFFER" not in line[0], line
    n = int(line[0].split("tokens: ")[1].split(" of ")[0])
    assert n > 20 and f"{n} of {n} reply prompts" in line[0]
    assert list(temp.iterdir()) == []


def test_split_report_names_a_remaining_difference(smollm2_dir, make_cfg):
    """llama3 on SmolLM2's tokenizer (its special tokens added): the generation prompt's "\\n\\n" is one token at the
    end of a text and two before a word, so later turns' history cannot equal serving: the report counts it and
    shows the first place."""
    from transformers import AutoTokenizer

    from dsrecipes.data.render.parity import split_report

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3}, replace_extra_special_tokens=False)
    encoder = Encoder(tok, _cfg(make_cfg, TemplateKind.llama3))
    rows = [{"input_ids": e.input_ids, "labels": e.labels, "position_ids": list(range(len(e.input_ids)))}
            for e in encoder.encode_batch(CONVS)]
    report = split_report(rows, tok)
    assert "DIFFER" in report and "of 9 reply prompts" in report and "ĊĊ" in report, report
    good = Encoder(_tokenizer("tiny", smollm2_dir), _cfg(make_cfg, TemplateKind.vicuna))
    rows = [{"input_ids": e.input_ids, "labels": e.labels, "position_ids": list(range(len(e.input_ids)))}
            for e in good.encode_batch(CONVS)]
    assert "9 of 9 reply prompts" in split_report(rows, _tokenizer("tiny", smollm2_dir))
