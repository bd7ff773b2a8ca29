"""data.train_on=last_assistant: a row whose last reply starts past data.cutoff_len keeps it and loses earlier turns
(LLaMA-Factory's mask_history gives the last turn the budget first), re-rendered by the template
(dsrecipes/data/render/history_cut.py). Before, such a row was dropped (dropped_all_trained_cut)."""

from __future__ import annotations

import dataclasses
import gzip
import json

import numpy as np
import pytest

from dsrecipes.core.paths import TINY_TOKENIZER_DIR
from dsrecipes.core.schema import RowKind, SourceConfig, TemplateConfig, TemplateKind, TrainConfig, TrainOn
from dsrecipes.data.prepare import cache
from dsrecipes.data.prepare.stats import summary
from dsrecipes.data.render import tokenize
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.preference_encode import PairEncoder
from dsrecipes.data.render.tokenize import Encoder
from dsrecipes.data.sources.preference import Pair
from dsrecipes.data.sources.sharegpt import BadRow, Conversation, Role, Turn, normalize_row

ASSETS = TINY_TOKENIZER_DIR.parent
# Llama-2's way: the system prompt folded into the first user turn (a slice of the full rendering would lose it)
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\\n' + messages[0]['content'] + "
          "'\\n<</SYS>>\\n\\n' %}{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}"
          "{% endif %}{% for m in msgs %}{% if m['role'] == 'user' %}{{ '[INST] ' + (sys if loop.first else '') + "
          "m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + ' </s>' }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


def encoder(tok, cutoff: int, template: TemplateKind = TemplateKind.chatml,
            train_on: TrainOn = TrainOn.last_assistant) -> Encoder:
    cfg = TrainConfig()
    cfg.template = TemplateConfig(name=template)
    cfg.data.cutoff_len, cfg.data.train_on = cutoff, train_on
    return Encoder(tok, cfg)


def chat(system: str = "Be brief.") -> Conversation:
    turns = [Turn(Role.user, "first question " * 10), Turn(Role.assistant, "first answer " * 10),
             Turn(Role.user, "second question"), Turn(Role.assistant, "second answer"),
             Turn(Role.user, "third question"), Turn(Role.assistant, "the final answer")]
    return Conversation("c", turns, system=system)


def from_turn(conv: Conversation, k: int) -> Conversation:
    return dataclasses.replace(conv, turns=conv.turns[k:])


def trained(tok, ex) -> str:
    return tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE_INDEX])


@pytest.mark.parametrize("template", [TemplateKind.chatml, TemplateKind.vicuna])
def test_a_last_reply_past_the_cutoff_is_kept_and_the_oldest_turns_go(tok, template):
    """Was: None (dropped). Now the sample is exactly the template's encoding of the conversation from the second
    user turn on (the most history that fits), system prompt kept, the final reply trained whole."""
    conv = chat()
    shorter = encoder(tok, 4096, template).encode(from_turn(conv, 2))
    full = encoder(tok, 4096, template).encode(conv)
    assert len(full.input_ids) > len(shorter.input_ids) + 10
    ex = encoder(tok, len(shorter.input_ids) + 5, template).encode(conv)
    assert ex is not None and ex.truncated
    assert (ex.input_ids, ex.labels) == (shorter.input_ids, shorter.labels)
    assert trained(tok, ex) == trained(tok, full) and "final answer" in trained(tok, ex)
    assert "Be brief." in tok.decode(ex.input_ids) and "first question" not in tok.decode(ex.input_ids)
    # one token less than that keeps the last exchange alone
    last = encoder(tok, 4096, template).encode(from_turn(conv, 4))
    ex = encoder(tok, len(shorter.input_ids) - 1, template).encode(conv)
    assert (ex.input_ids, ex.labels) == (last.input_ids, last.labels)


def test_a_template_folding_the_system_prompt_into_the_first_turn_renders_the_shorter_conversation(tok):
    """Llama-2 style: the kept history's first user turn carries <<SYS>>, which no slice of the full tokens has."""
    llama2 = tok.__class__.from_pretrained(str(TINY_TOKENIZER_DIR))
    llama2.chat_template = LLAMA2
    conv = chat()
    shorter = encoder(llama2, 4096, TemplateKind.tokenizer).encode(from_turn(conv, 4))
    ex = encoder(llama2, len(shorter.input_ids) + 2, TemplateKind.tokenizer).encode(conv)
    assert (ex.input_ids, ex.labels) == (shorter.input_ids, shorter.labels)
    assert tok.decode(ex.input_ids).startswith("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nthird question [/INST]")
    full = encoder(llama2, 4096, TemplateKind.tokenizer).encode(conv)
    assert full.input_ids[-len(ex.input_ids):] != ex.input_ids


def test_a_system_prompt_that_fills_the_cutoff_with_the_last_prompt_still_drops_the_row(tok):
    """The system prompt and tools are never cut: a row whose last exchange's reply starts past the cutoff even
    without history is dropped (counted as dropped_all_trained_cut); one whose last reply starts before the cutoff
    but does not fit is cut mid-reply, as the last exchange alone."""
    conv = chat(system="You are a helpful assistant. " * 20)
    alone = encoder(tok, 4096).encode(from_turn(conv, 4))
    prompt = sum(lab == IGNORE_INDEX for lab in alone.labels)
    assert encoder(tok, prompt - 1).encode(conv) is None
    ex = encoder(tok, prompt + 2).encode(conv)
    assert ex.input_ids == alone.input_ids[:prompt + 2] and sum(lab != IGNORE_INDEX for lab in ex.labels) == 2


def _bundled():
    rows = [json.loads(line) for line in open(ASSETS / "sample_data" / "train.jsonl")][:200]
    with gzip.open(ASSETS / "glaive_toolcall" / "glaive_toolcall_en_demo.json.gz") as fh:
        rows += json.load(fh)[:150]
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(normalize_row(row, f"r{i}", SourceConfig(name="s", paths=["x"])))
        except BadRow:
            continue
    return out


@pytest.mark.parametrize("template", [TemplateKind.chatml, TemplateKind.vicuna])
def test_every_row_the_old_rule_keeps_encodes_byte_identically_on_the_bundled_data(tok, template, monkeypatch):
    """Only rows dropped before change: ids, labels and the truncated flag of every other row are the same as with
    the history cut switched off (the glaive tool-call demo has long multi-turn rows, so many rows are cut)."""
    convs = _bundled()
    enc = encoder(tok, 96, template)
    now = enc.encode_batch(convs, [])
    monkeypatch.setattr(tokenize, "cut_history", lambda _e, convs, _r, _s: np.zeros(len(convs), dtype=bool))
    before = enc.encode_batch(convs, [])
    assert len(now) == len(before) == len(convs)
    changed = [(a, b) for a, b in zip(before, now) if a is not None]
    assert all((a.input_ids, a.labels, a.truncated) == (b.input_ids, b.labels, b.truncated) for a, b in changed)
    gained = [b for a, b in zip(before, now) if a is None and b is not None]
    assert len(gained) > 20, len(gained)
    assert all(b.truncated and len(b.input_ids) <= 96 for b in gained)
    assert all(lab == IGNORE_INDEX or tid == lab for b in gained for tid, lab in zip(b.input_ids, b.labels))


def test_other_train_on_and_preference_pairs_are_untouched(tok, monkeypatch):
    """train_on=assistant never calls the history cut, nor do preference pairs (rendered with last_assistant: TRL's
    truncation keeps the prompt's tail, preference_encode.py)."""
    def refuse(*_a):
        raise AssertionError("history cut called")

    conv = chat()
    monkeypatch.setattr(tokenize, "cut_history", refuse)
    assert encoder(tok, 200, train_on=TrainOn.assistant).encode(conv).truncated  # the head, as ever
    cfg = TrainConfig()
    cfg.template = TemplateConfig(name=TemplateKind.chatml)
    cfg.data.cutoff_len = 300
    pair = Pair(dataclasses.replace(conv, turns=conv.turns[:-1]), "yes " * 100, "no")
    [row] = PairEncoder(tok, cfg).encode_batch([pair])
    assert row["truncated"] and len(row["prompt_ids"]) + len(row["chosen_ids"]) <= 300


def test_the_cache_key_changes_for_last_assistant_conversations_alone(tok, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(cache, "_digest", lambda material: seen.append(material) or "k")
    for train_on, rows in ((TrainOn.last_assistant, RowKind.conversation), (TrainOn.assistant, RowKind.conversation),
                           (TrainOn.last_assistant, RowKind.pair)):
        cfg = TrainConfig()
        cfg.data.cache_dir, cfg.data.train_on, cfg.objective.rows = str(tmp_path), train_on, rows
        cache.cache_key(cfg, tok, [])
    assert [m.get("history_cut") for m in seen] == [cache.HISTORY_CUT, None, None]


def test_the_summary_counts_history_cut_rows_and_the_note_names_what_is_left(tok):
    stats = {"rows_read": 10, "rows_kept": 9, "skipped": {}, "samples": {"train": 9, "val": 0},
             "rows": {"train": 9, "val": 0}, "truncated": 4, "dropped_all_trained_cut": 1, "history_cut": 3,
             "trailing_turns_dropped": 0, "trained_token_share": 0.2, "train_on": "last_assistant", "cutoff_len": 64,
             "packing_efficiency": {"train": None}}
    said = summary(stats)
    assert "1 dropped (nothing trained left), 3 kept their last reply by dropping earlier turns" in said, said
    assert "system prompt, tool schemas and last prompt turn alone fill the cutoff" in said, said
    del stats["history_cut"]  # a preparation cached before the count: no words
    assert "kept their last reply" not in summary(stats)
