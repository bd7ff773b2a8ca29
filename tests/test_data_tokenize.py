"""Truncation policy, packing (best-fit-decreasing) and the streaming encode path (dsrecipes.data.render.tokenize)."""

from __future__ import annotations

import random

import pytest

from dsrecipes.core.paths import TINY_TOKENIZER_DIR
from dsrecipes.core.schema import TemplateConfig, TemplateKind, TrainConfig, TrainOn
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.packing import pack, pack_plan, packing_efficiency
from dsrecipes.data.render.tokenize import Encoder, Example
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


def encoder(tok, cutoff_len: int, train_on: TrainOn = TrainOn.assistant) -> Encoder:
    cfg = TrainConfig()
    cfg.template = TemplateConfig(name=TemplateKind.chatml)
    cfg.data.cutoff_len = cutoff_len
    cfg.data.train_on = train_on
    return Encoder(tok, cfg)


def conv(*texts: str, system: str | None = None) -> Conversation:
    roles = [Role.user, Role.assistant] * len(texts)
    return Conversation("c", [Turn(r, t) for r, t in zip(roles, texts)], system=system)


def decode_trained(tok, ex: Example) -> str:
    return tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE_INDEX])


def test_no_truncation_and_trailing_newline_dropped(tok):
    ex = encoder(tok, 512).encode(conv("What is 2 + 2?", "2 + 2 = 4."))
    assert not ex.truncated
    assert tok.decode(ex.input_ids).endswith("2 + 2 = 4.<|im_end|>")  # no "\n" after the final reply


def test_truncation_cuts_whole_turns_from_the_end(tok):
    c = conv("What is 2 + 2?", "2 + 2 = 4.", "What is 3 + 3?", "3 + 3 = 6.")
    full = encoder(tok, 512).encode(c)
    first_turn_len = len(encoder(tok, 512).encode(conv("What is 2 + 2?", "2 + 2 = 4.")).input_ids)
    ex = encoder(tok, len(full.input_ids) - 1).encode(c)
    assert ex.truncated and len(ex.input_ids) == first_turn_len
    assert decode_trained(tok, ex) == "2 + 2 = 4.<|im_end|>"
    assert ex.input_ids == full.input_ids[:first_turn_len]


def test_truncation_mid_reply_when_no_whole_turn_fits(tok):
    long_reply = " ".join(["word"] * 60)
    c = conv("Say many words.", long_reply)
    prompt_len = len(tok("<|im_start|>user\nSay many words.<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    ex = encoder(tok, prompt_len + 5).encode(c)
    assert ex.truncated and len(ex.input_ids) == prompt_len + 5
    assert sum(lab != IGNORE_INDEX for lab in ex.labels) == 5
    assert encoder(tok, prompt_len).encode(c) is None  # nothing trained left: dropped


def test_last_assistant_falls_back_to_a_hard_cut(tok):
    c = conv("q1", "a1", "q2", "a2 " * 20)
    full = encoder(tok, 512, TrainOn.last_assistant).encode(c)
    ex = encoder(tok, len(full.input_ids) - 3, TrainOn.last_assistant).encode(c)
    # whole-turn truncation would leave only the untrained first reply, so the final reply is cut instead
    assert ex.truncated and len(ex.input_ids) == len(full.input_ids) - 3
    assert decode_trained(tok, ex).startswith("a2")


def test_template_error_collected_in_batches(tok):
    class Refusing:  # a model's template that declines the conversation (rendered in chat_sandbox)
        chat_template = "{{ raise_exception('roles must alternate') }}"

        def __getattr__(self, name):
            return getattr(tok, name)

    cfg = TrainConfig()
    cfg.template = TemplateConfig(name=TemplateKind.tokenizer)
    enc = Encoder(tok, cfg)
    enc.tokenizer = Refusing()
    errors = []
    assert enc.encode_batch([conv("q", "a")], errors) == [None]
    assert errors[0][1].reason is BadReason.template_error and "alternate" in errors[0][1].detail
    with pytest.raises(BadRow):
        enc.encode(conv("q", "a"))



def test_pack_plan_is_deterministic_and_complete():
    rng = random.Random(0)
    lengths = [min(512, max(4, int(rng.lognormvariate(4.0, 1.0)))) for _ in range(5000)]
    rows = pack_plan(lengths, 512)
    assert rows == pack_plan(lengths, 512)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    eff = packing_efficiency(sum(lengths), len(rows), 512)
    assert eff >= 0.95, eff  # long-tailed lengths still pack densely


def test_pack_rows_positions_and_boundary_labels():
    examples = [Example("a", [1, 2, 3], [1, 2, 3]), Example("b", [4, 5], [IGNORE_INDEX, 5]), Example("c", [6, 7, 8, 9], [6, 7, 8, 9])]
    rows = pack(examples, 6)
    assert [r.ids for r in rows] == [["c", "b"], ["a"]]
    c_b = rows[0]
    assert c_b.input_ids == [6, 7, 8, 9, 4, 5]
    assert c_b.position_ids == [0, 1, 2, 3, 0, 1]
    assert c_b.labels == [IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX, 5]  # no prediction across a sample boundary
    with pytest.raises(ValueError, match="exceeds cutoff_len"):
        pack_plan([7], 6)
