"""A preference pair whose prompt holds earlier answers is refused under SFT, not trained on its history.

Before, `sharegpt.normalize_row` stopped a pair only when its conversation had no assistant turn (a single-turn
prompt: no_assistant_turn with the pair advice). A pair whose prompt was multi-turn (user, assistant, user) read as an
SFT conversation: the run trained on the prompt's history alone, chosen/rejected unread, exit 0. With
`dataset.bad_rows=skip` a mixed file such as sample_pairs trained 400 of its 596 rows that way."""

from __future__ import annotations

import json

import pytest

from tests.test_walk4 import _error_line_of_many

PAIR = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello! How can I help?"},
                          {"from": "human", "value": "Say something kind."}],
        "chosen": {"from": "gpt", "value": "You are doing great."}, "rejected": {"from": "gpt", "value": "No."}}


def test_the_row_is_refused_as_a_pair_with_what_reads_it():
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.data.sources.badrows import BadReason, BadRow
    from dsrecipes.data.sources.sharegpt import normalize_row

    with pytest.raises(BadRow) as bad:
        normalize_row(PAIR, "p0", SourceConfig(name="p"))
    assert bad.value.reason is BadReason.preference_row, bad.value
    assert "'chosen', 'rejected'" in bad.value.detail and "objective=dpo" in bad.value.advice
    plain = {"conversations": PAIR["conversations"][:2], "answer": "4"}  # an SFT row with an extra column trains
    assert normalize_row(plain, "s0", SourceConfig(name="p")).turns[-1].content == "Hello! How can I help?"


@pytest.mark.parametrize("data", ["map", "iterable"])
def test_a_file_of_multi_turn_pairs_under_sft_is_refused_at_its_first_line(tmp_path, capsys, monkeypatch, data):
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps({**PAIR, "id": str(i)}) + "\n" for i in range(24)))
    stream = ["trainer.max_steps=2", "scheduler.warmup_steps=0"] if data == "iterable" else []
    err = _error_line_of_many(capsys, ["train", "debug=fast", "dataset=sharegpt_files", f"dataset.paths=[{rows}]",
                                       "dataset.val_size=0", f"data={data}", *stream, "trainer.export=false",
                                       f"data.cache_dir={tmp_path / 'cache'}", "trainer.output_dir=runs/x"])
    assert "preference_row" in err and "this looks like a preference pair" in err and "objective=dpo" in err, err
    assert "bad_rows=skip" not in err, err
