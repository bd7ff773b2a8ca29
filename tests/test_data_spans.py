"""One-text tokenization (data/render/spans.py) against per-segment tokenization, and its border rules.

The tiny tokenizer has no merge across the borders our templates produce, so there the two must agree token for
token. A BPE tokenizer trained here (with "\\n\\n" and " word" merges) makes the borders bite: a token straddling a
border, and a prompt whose last piece tokenizes differently before a reply than alone (what inference sees).
"""

from __future__ import annotations

from typing import List

import pytest

from dsrecipes.core.schema import TemplateKind, TrainOn
from dsrecipes.data.render.template import render
from dsrecipes.data.render.tokenize import IGNORE_INDEX, Encoder, Example
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn
from tests.test_data_template import make_cfg, sample_convs

EDGES = ["\nHello", "\n\nHello", " Hello", "  Hello", "Hello ", "Hello\n", "Hello\n\n", "'s fine", "法国", " 法国",
         "\t\tx", "", " ", "\n", "a  \n b"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


@pytest.fixture(scope="module", params=["bytes", "offsets"])
def merging_tok(request):
    """Byte-level BPE (GPT-2 pre-tokenizer) trained to merge "\\n\\n", " Hello" and friends. Two ways to find the
    borders: by token byte lengths, or (with a normalizer, even one that changes nothing here) by character offsets."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "</s>"]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    corpus = ["Hello world.\n\nSay Hello there, user and assistant!\n\n\nHello again: 2 + 2 = 4. Hello\n"] * 50
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert raw.token_to_id("ĊĊ") is not None and raw.token_to_id("ĠHello") is not None
    if request.param == "offsets":
        raw.normalizer = normalizers.NFC()
    out = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>")
    from dsrecipes.data.render.spans import FullText

    assert (FullText(out.backend_tokenizer)._byte_len is None) == (request.param == "offsets")
    return out


def edge_convs() -> List[Conversation]:
    out = []
    for a in EDGES:
        for q in ["q", "q ", "q\n", "法国"]:
            turns = [Turn(Role.user, q), Turn(Role.assistant, a), Turn(Role.user, a + q), Turn(Role.assistant, q + a)]
            out.append(Conversation(f"edge{len(out)}", turns, system=a or None))
    return out


def pairs(examples: List[Example]):
    return [None if e is None else (e.input_ids, e.labels, e.truncated) for e in examples]


def assert_exact_labels(tokenizer, encoder: Encoder, convs: List[Conversation]) -> None:
    """Trained tokens decode to exactly the trained segments' text (train_on=assistant)."""
    for conv, ex in zip(convs, encoder.encode_batch(convs)):
        trained = "".join(s.text for s in encoder.render(conv) if s.trained)
        got = tokenizer.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE_INDEX])
        assert got == trained, conv.id


@pytest.mark.parametrize("template", list(TemplateKind))
@pytest.mark.parametrize("train_on", list(TrainOn))
def test_one_text_equals_per_segment_on_the_tiny_tokenizer(tok, template, train_on):
    convs = sample_convs() + edge_convs()
    fast = Encoder(tok, make_cfg(template, train_on, cutoff_len=64))  # short cutoff: truncation at the borders too
    slow = Encoder(tok, make_cfg(template, train_on, cutoff_len=64), full_text=False)
    # every template's prompt ends where a token ends (vicuna/plain/human_assistant at "ASSISTANT:", the space goes
    # with the reply's first word): the one-text path serves them all
    assert fast.full_text
    batch = fast.encode_arrays(convs)
    assert batch.per_segment == 0
    assert pairs(fast.encode_batch(convs)) == pairs(slow.encode_batch(convs))


def test_straddling_token_falls_back_to_per_segment(merging_tok):
    # "assistant\n" + "\n\nHello": GPT-2's regex cuts "\n\n\nHello" as "\n\n", "\n", "Hello", and BPE makes the
    # first piece one token across the border
    conv = Conversation("s", [Turn(Role.user, "q"), Turn(Role.assistant, "\n\nHello")])
    enc = Encoder(merging_tok, make_cfg(TemplateKind.chatml))
    assert enc.full_text
    text = "".join(s.text for s in enc.render(conv))
    whole = merging_tok(text, add_special_tokens=False)["input_ids"]
    assert merging_tok.convert_tokens_to_ids("ĊĊ") in whole  # the straddling token exists in one-text tokens
    batch = enc.encode_arrays([conv])
    assert batch.per_segment == 1
    assert pairs(enc.encode_batch([conv])) == pairs(Encoder(merging_tok, make_cfg(TemplateKind.chatml),
                                                            full_text=False).encode_batch([conv]))
    assert_exact_labels(merging_tok, enc, [conv])


def test_prompt_tokens_are_what_inference_tokenizes(merging_tok):
    """Before every reply, the sample holds exactly the tokens of the text up to that reply tokenized alone (how
    the prompt reaches the model at inference), on every template that takes the one-text path."""
    convs = sample_convs()[:60] + edge_convs()
    for template in [t for t in TemplateKind if t is not TemplateKind.tokenizer]:  # it has no chat_template
        enc = Encoder(merging_tok, make_cfg(template))
        for conv, ex in zip(convs, enc.encode_batch(convs)):
            segs = enc.render(conv)
            pos, text = 0, "".join(s.text for s in segs)
            starts = []
            for s in segs:
                if s.closes_turn:
                    starts.append(pos)
                pos += len(s.text)
            first = starts[0]
            alone = merging_tok(text[:first], add_special_tokens=False)["input_ids"]
            assert ex.input_ids[: len(alone)] == alone, (template, conv.id)
        assert_exact_labels(merging_tok, enc, convs)


def test_look_ahead_in_the_prompt_is_caught(merging_tok):
    # llama3's header ends in "\n\n": alone it is one "ĊĊ" token, before a word GPT-2's regex splits it in two.
    conv = Conversation("l", [Turn(Role.user, "q"), Turn(Role.assistant, "Hello")])
    cfg = make_cfg(TemplateKind.llama3)
    text = "".join(s.text for s in render(conv, cfg.template, merging_tok, TrainOn.assistant))
    head = text[: text.index("Hello")]
    alone = merging_tok(head, add_special_tokens=False)["input_ids"]
    assert merging_tok(text, add_special_tokens=False)["input_ids"][: len(alone)] != alone
    enc = Encoder(merging_tok, cfg)
    assert not enc.full_text  # the probe met the same border and switched the template to per-segment
    forced = Encoder(merging_tok, cfg, full_text=True)
    assert forced.encode_arrays([conv]).per_segment == 1  # and per conversation, the check falls back
    assert pairs(forced.encode_batch([conv])) == pairs(enc.encode_batch([conv]))
    assert enc.encode(conv).input_ids[: len(alone)] == alone


def test_a_conversation_longer_than_the_long_text_threshold_is_never_one_text(tok):
    """Issue 11's memory bound holds on the fast path: the one-text tokenizer never sees a segment longer than
    `long_text` characters nor a conversation longer than ONE_TEXT_SEGMENTS of them (thousands of short turns, or one
    huge turn); those go per segment (long texts by their head), with the result per-segment tokenization gives. A
    chat of many turns in between (past cutoff_len, as real chats often are) keeps the fast path."""
    from dsrecipes.data.render.tokenize import ONE_TEXT_SEGMENTS

    cfg = make_cfg(TemplateKind.chatml, TrainOn.assistant, cutoff_len=16)
    fast, slow = Encoder(tok, cfg), Encoder(tok, cfg, full_text=False)
    assert fast.full_text and fast.long_text == 8 * (16 + 64)
    seen: List[int] = []
    spans = fast._full.spans
    fast._full.spans = lambda texts, replies: seen.extend(sum(map(len, t)) for t in texts) or spans(texts, replies)
    turns = lambda n: [Turn(Role.user if i % 2 == 0 else Role.assistant, f"turn {i} " * 5) for i in range(n)]  # noqa: E731
    many = Conversation("many", turns(40))
    endless = Conversation("endless", turns(600))
    huge = Conversation("huge", [Turn(Role.user, "q"), Turn(Role.assistant, "lorem ipsum " * 5000)])
    short = Conversation("short", [Turn(Role.user, "q"), Turn(Role.assistant, "a short reply")])
    batch = fast.encode_arrays([many, short, huge, endless])
    assert len(seen) == 2 and fast.long_text < max(seen) <= ONE_TEXT_SEGMENTS * fast.long_text
    assert batch.per_segment == 2  # huge and endless
    assert fast.encode_batch([many, short, huge, endless]) == slow.encode_batch([many, short, huge, endless])
