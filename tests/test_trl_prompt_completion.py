"""TRL's prompt/completion rows read by `dataset=openai_messages` (data/sources/row_shapes.py): a TRL user's SFT
dataset trains as it is. Each shape is read as exactly the conversation it stands for (the prompt's turns as
context, the completion trained, as TRL's completion-only loss), in JSON lines and in Parquet; the tokens the
rendering trains are the completion's alone; a row of mixed types is one bad row naming both columns; the same
rows under the ShareGPT reader, and TRL's `text` rows, get the advice that reads them; a real run trains on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import BadRows, ColumnsConfig, DatasetFormat, SourceConfig
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.sharegpt import Role, iter_source
from tests.conftest import in_process_environ

STANDARD = {"prompt": "What is 2+2?", "completion": "4"}
CONVERSATIONAL = {
    "prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}],
    "completion": [{"role": "assistant", "content": "Paris."}],
}


def openai_source(path: Path) -> SourceConfig:
    return SourceConfig(name="trl", paths=[str(path)], format=DatasetFormat.openai,
                        columns=ColumnsConfig(messages="messages", role="role", content="content"))


def read(path: Path, src=None, policy=BadRows.error):
    report = BadRowReport(policy, 1.0)
    return list(iter_source(src or openai_source(path), report))


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def shape(conv):
    return conv.system, [(t.role, t.content, t.trained) for t in conv.turns]


def test_each_shape_reads_as_the_conversation_it_stands_for(tmp_path):
    convs = read(write_jsonl(tmp_path / "pc.jsonl", [STANDARD, CONVERSATIONAL]))
    assert shape(convs[0]) == (None, [(Role.user, "What is 2+2?", True), (Role.assistant, "4", True)])
    assert shape(convs[1]) == ("Be terse.", [(Role.user, "Hi", True), (Role.assistant, "Hello.", False),
                                             (Role.user, "Capital of France?", True), (Role.assistant, "Paris.", True)])
    # the same conversations as TRL's `messages` rows (the prompt's answer at OpenAI's weight 0) read alike
    messages = [{"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
                {"messages": CONVERSATIONAL["prompt"][:2] + [{**CONVERSATIONAL["prompt"][2], "weight": 0}]
                 + CONVERSATIONAL["prompt"][3:] + CONVERSATIONAL["completion"]}]
    assert [shape(c) for c in read(write_jsonl(tmp_path / "m.jsonl", messages))] == [shape(c) for c in convs]


def test_parquet_prompt_completion_columns_are_read(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([STANDARD, {"prompt": "Hi", "completion": "Hello!"}]), tmp_path / "pc.parquet")
    convs = read(tmp_path / "pc.parquet")
    assert [shape(c)[1][-1] for c in convs] == [(Role.assistant, "4", True), (Role.assistant, "Hello!", True)]


@pytest.mark.parametrize("row, types", [({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]},
                                         "str/list"),
                                        ({"prompt": [{"role": "user", "content": "x"}], "completion": []}, "list/list"),
                                        ({"prompt": "x", "completion": None}, "str/NoneType")])
def test_a_row_of_mixed_types_is_one_bad_row_naming_both_columns(tmp_path, row, types):
    with pytest.raises(DataError, match=rf"bad_value \('prompt'/'completion': {types}, not two strings \(TRL "
                                        r"standard\) or two message lists \(the completion non-empty\)\)"):
        read(write_jsonl(tmp_path / "bad.jsonl", [row]))


def test_the_sharegpt_reader_and_text_rows_get_the_advice_that_reads_them(tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [STANDARD])
    with pytest.raises(DataError, match=r"no 'conversations' field \(keys: \['completion', 'prompt'\]\); TRL's "
                                        r"prompt/completion rows: read them with dataset=openai_messages"):
        read(path, SourceConfig(name="s", paths=[str(path)]))
    with pytest.raises(DataError, match=r"a 'text' row \(TRL's language modeling\) is no conversation"):
        read(write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}]))


def test_only_the_completion_is_trained_and_a_run_trains_on_them(tmp_path, capsys):
    """inspect-data shows the trained tokens in [[...]]: the completion only, not the prompt's earlier answer; then
    a real run (tiny model, 4 steps) on the rows ends with a finite, lower loss."""
    from dsrecipes.cli import main

    path = write_jsonl(tmp_path / "pc.jsonl", [STANDARD, CONVERSATIONAL] * 20)
    common = ["dataset=openai_messages", f"dataset.paths=[{path}]", "dataset.val_size=0"]
    with in_process_environ():
        assert main(["inspect-data", *common, f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    out = capsys.readouterr().out
    assert "[[Paris.<|im_end|>]]" in out and "[[4<|im_end|>]]" in out, out
    assert "assistant\nHello.<|im_end|>" in out and "[[Hello." not in out, out
    run = tmp_path / "run"
    with in_process_environ():
        assert main(["debug=fast", *common, "trainer.max_steps=4", "trainer.eval_every=0", "trainer.export=false",
                     f"trainer.output_dir={run}", f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert losses and all(loss == loss for loss in losses) and losses[-1] < losses[0], losses


def test_only_the_openai_reader_reads_a_parquet_completion_column():
    """A Parquet row is the columns its reader reads, and dataset.split's row id hashes that row: another format keeps
    the row (and its share) it had before prompt/completion rows were read."""
    from dsrecipes.data.sources.files import used_columns

    assert "completion" in used_columns(openai_source(Path("x.parquet")))
    assert "completion" not in used_columns(SourceConfig(name="s", paths=["x.parquet"]))
    assert "completion" not in used_columns(SourceConfig(name="s", paths=["x.parquet"], format=DatasetFormat.alpaca))
