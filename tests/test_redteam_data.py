"""Red-team cases for data in: hostile registries and rows, each one message (never a traceback) or trained as
served."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dsrecipes.core.errors import ConfigError, DataError
from dsrecipes.data.sources.registry import load_registry

TAGS = {"role_tag": "speaker", "content_tag": "text", "user_tag": "client", "assistant_tag": "agent"}


@pytest.mark.parametrize("extra,message", [
    ({"columns": ["dialog"]}, "dataset.registry.x.columns: expected a mapping of names to strings, got list"),
    ({"tags": "speaker"}, "dataset.registry.x.tags: expected a mapping of names to strings, got str"),
    ({"tags": {**TAGS, "user_tag": {"a": 1}}}, "dataset.registry.x.tags.user_tag: expected a non-empty string"),
    ({"columns": {"messages": 5}}, "dataset.registry.x.columns.messages: expected a non-empty string, got 5"),
    ({"num_samples": "abc"}, "dataset.registry.x.num_samples: must be a whole number >= 1, got 'abc'"),
    ({"num_samples": 1e400}, "dataset.registry.x.num_samples: must be a whole number >= 1, got inf"),
    ({"num_samples": -3}, "dataset.registry.x.num_samples: must be a whole number >= 1, got -3"),
    ({"ranking": "false"}, "dataset.registry.x.ranking: must be true or false, got 'false'"),
    ({"tags": {**TAGS, "user_tag": "agent"}}, "dataset.registry.x.tags: user_tag and assistant_tag are both 'agent'"),
])
def test_a_dataset_info_entry_with_odd_columns_tags_or_counts_is_one_message(tmp_path, extra, message):
    """Was: a list for `columns`/`tags` or a dict as a tag was an AttributeError/TypeError traceback, num_samples
    'abc' or 1e400 a ValueError/OverflowError traceback; -3, a number as a column and two roles with one tag value
    (the later silently won: every such turn one role) were accepted."""
    entry = {"file_name": "rows.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"}, "tags": TAGS}
    registry = tmp_path / "dataset_info.json"
    registry.write_text(json.dumps({"x": {**entry, **extra}}), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_registry(str(registry), ["x"])
    assert message in str(err.value)


def test_a_plain_dataset_info_entry_still_reads(tmp_path):
    entry = {"file_name": "rows.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"}, "tags": TAGS,
             "num_samples": 5, "ranking": None}
    registry = tmp_path / "dataset_info.json"
    registry.write_text(json.dumps({"x": entry}), encoding="utf-8")
    src = load_registry(str(registry), ["x"])["x"]
    assert src.max_samples == 5 and not src.ranking
    assert src.roles["client"] == "user" and src.roles["agent"] == "assistant"


# --- a registry entry's settings, mixing weights and the prepared cache -------------------------------------------


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


@pytest.fixture(scope="module")
def base_cfg():
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(["dataset.val_size=0"])  # composed once: Hydra is slow


ROW = {"dialog": [{"speaker": "client", "text": "hello"}, {"speaker": "agent", "text": "hi there"}]}


def registry_cfg(base_cfg, tmp_path, weight, agent="assistant", rows=6, **extra):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({**ROW, "id": str(i)}) + "\n" for i in range(rows)))
    registry = tmp_path / "reg.yaml"
    registry.write_text("x:\n  paths: [rows.jsonl]\n  columns: {messages: dialog, role: speaker, content: text}\n"
                        f"  roles: {{client: user, agent: {agent}}}\n  weight: {weight}\n")
    dataset = dataclasses.replace(base_cfg.dataset, registry=str(registry), use=["x"], **extra)
    data = dataclasses.replace(base_cfg.data, cache_dir=str(tmp_path / "cache"))
    return dataclasses.replace(base_cfg, dataset=dataset, data=data)


def test_an_edited_registry_entry_is_prepared_again_not_taken_from_the_cache(base_cfg, tok, tmp_path):
    """Was: the cache key held cfg.dataset (the registry's path) and each file's contents, not the entry read from
    the registry file, so changing its weight (or roles, columns, caps) hit the old preparation: weight 1 -> 2 still
    trained 6 samples, roles changed so nothing is an assistant turn still trained the old replies."""
    from dsrecipes.data.prepare.build import prepare

    assert len(prepare(registry_cfg(base_cfg, tmp_path, 1), tok, tmp_path / "run1").train) == 6
    assert len(prepare(registry_cfg(base_cfg, tmp_path, 2), tok, tmp_path / "run2").train) == 12
    with pytest.raises(DataError, match="no_assistant_turn"):
        prepare(registry_cfg(base_cfg, tmp_path, 2, agent="user"), tok, tmp_path / "run3")


def test_weights_that_leave_no_training_sample_are_one_message_not_an_empty_cache(base_cfg, tok, tmp_path):
    """Was: weight 0.1 on 2 samples (round(0.2) = 0) published a prepared cache without a train split; that run and
    every later one (a cache hit) ended in '.../train: not a readable prepared split ...; prepare the data again'."""
    from dsrecipes.data.prepare.build import prepare

    cfg = registry_cfg(base_cfg, tmp_path, 0.1, rows=2)
    for run in ("run1", "run2"):
        with pytest.raises(DataError, match=r"the mixing weights leave no training samples \(weight x 0.1"):
            prepare(cfg, tok, tmp_path / run)


@pytest.mark.parametrize("where,change,message", [
    ("registry", {"weight": 0}, "dataset.registry.x.weight: must be a finite number > 0, got 0"),
    ("registry", {"max_samples": 0}, "dataset.registry.x.max_samples: must be >= 1, got 0"),
    ("sources", {"max_samples": -3}, "dataset.sources[0].max_samples: must be >= 1, got -3"),
])
def test_a_source_that_would_read_nothing_is_refused(tmp_path, where, change, message):
    """Was: validate said OK and the source was silently left out of the mix (alone: an empty preparation)."""
    from dsrecipes.core.schema import DatasetConfig, SourceConfig
    from dsrecipes.data.sources.registry import resolve_sources

    (tmp_path / "rows.jsonl").write_text(json.dumps({"conversations": []}) + "\n")
    if where == "registry":
        (tmp_path / "reg.yaml").write_text("x:\n  paths: [rows.jsonl]\n" + "".join(f"  {k}: {v}\n"
                                                                                  for k, v in change.items()))
        ds = DatasetConfig(registry=str(tmp_path / "reg.yaml"), use=["x"])
    else:
        ds = DatasetConfig(sources=[SourceConfig(paths=[str(tmp_path / "rows.jsonl")], **change)])
    with pytest.raises(ConfigError) as err:
        resolve_sources(ds)
    assert message in str(err.value)


# --- OpenAI fine-tuning rows: a message's "weight" ------------------------------------------------------------------


def openai_row(weight):
    return {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "EXCLUDED", "weight": weight},
                         {"role": "user", "content": "q2"},
                         {"role": "assistant", "content": "kept reply"}]}


@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_an_openai_message_with_weight_0_is_context_not_trained(base_cfg, tok, train_on):
    """Was: OpenAI's per-message `"weight": 0` (train on this message: no) was ignored, so the replies a dataset
    excluded from training were trained on, with every train_on."""
    from dsrecipes.core.schema import DatasetFormat, SourceConfig, TemplateKind, TrainOn
    from dsrecipes.data.render.labels import IGNORE_INDEX
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.sharegpt import normalize_row

    cfg = dataclasses.replace(base_cfg, template=dataclasses.replace(base_cfg.template, name=TemplateKind.chatml),
                              data=dataclasses.replace(base_cfg.data, train_on=TrainOn(train_on)))
    source = SourceConfig(name="o", format=DatasetFormat.openai)
    source.columns = dataclasses.replace(source.columns, messages="messages", role="role", content="content")
    encoder = Encoder(tok, cfg)
    ex = encoder.encode(normalize_row(openai_row(0), "r", source))
    trained = tok.decode([t for t, x in zip(ex.input_ids, ex.labels) if x != IGNORE_INDEX])
    assert "kept reply" in trained and "EXCLUDED" not in trained
    assert "EXCLUDED" in tok.decode(ex.input_ids)  # still the context of the next reply
    ex1 = encoder.encode(normalize_row(openai_row(1), "r", source))
    assert "EXCLUDED" in tok.decode([t for t, x in zip(ex1.input_ids, ex1.labels) if x != IGNORE_INDEX])


@pytest.mark.parametrize("weight", ["0", 0.5, True, None])
def test_an_openai_weight_other_than_0_or_1_is_a_bad_row(weight):
    from dsrecipes.core.schema import DatasetFormat, SourceConfig
    from dsrecipes.data.sources.badrows import BadRow
    from dsrecipes.data.sources.sharegpt import normalize_row

    source = SourceConfig(name="o", format=DatasetFormat.openai)
    source.columns = dataclasses.replace(source.columns, messages="messages", role="role", content="content")
    with pytest.raises(BadRow, match="turn 1: 'weight' must be 0 or 1"):
        normalize_row(openai_row(weight), "r", source)


def test_the_quarantine_of_a_file_of_tiny_bad_rows_is_bounded(tmp_path, monkeypatch):
    """Was: every bad row was written, ~133 bytes for a 2-byte element: a 2 MB `[1,1,...]` file (say, a JSON file of
    numbers caught by a glob) wrote a 133 MB quarantine.jsonl before the run stopped, and one copy more into the
    cache. Now entries stop at QUARANTINE_MAX_BYTES (64 MiB); the rest are counted, and the last line and the
    message say how many were not written."""
    import dsrecipes.data.sources.badrows as badrows
    from dsrecipes.core.schema import BadRows

    monkeypatch.setattr(badrows, "QUARANTINE_MAX_BYTES", 4096, raising=False)
    report = badrows.BadRowReport(BadRows.skip, 0.01, tmp_path / "quarantine.jsonl")
    for i in range(10_000):
        report.add("numbers.json", 1, badrows.BadRow(badrows.BadReason.not_an_object, "row is a int"), 1, element=i)
    report.rows_read = 10_001
    with pytest.raises(DataError) as err:
        report.check()
    assert "10000 of 10001 rows are bad" in str(err.value)
    lines = (tmp_path / "quarantine.jsonl").read_text().splitlines()
    assert (tmp_path / "quarantine.jsonl").stat().st_size < 4096 + 500
    written = len(lines) - 1
    assert 10 < written < 100 and all(json.loads(x)["reason"] == "not_an_object" for x in lines[:-1])
    note = f"{10_000 - written} more bad rows were counted but not written"
    assert note in json.loads(lines[-1])["detail"] and note in str(err.value)


def test_a_weight_0_message_stays_context_in_the_parts_dsrecipes_shard_writes():
    """The canonical row of a shard part keeps `"weight": 0`, and reading the part (format sharegpt) honours it, so
    data=presharded trains the same tokens as map and iterable."""
    from dsrecipes.core.schema import DatasetFormat, SourceConfig
    from dsrecipes.data.sources.samples import canonical_row
    from dsrecipes.data.sources.sharegpt import normalize_row

    source = SourceConfig(name="o", format=DatasetFormat.openai)
    source.columns = dataclasses.replace(source.columns, messages="messages", role="role", content="content")
    row = canonical_row(normalize_row(openai_row(0), "r", source))
    assert row["conversations"][1] == {"from": "assistant", "value": "EXCLUDED", "weight": 0}
    assert "weight" not in row["conversations"][3]
    again = normalize_row(json.loads(json.dumps(row)), "r", SourceConfig(name="part"))
    assert [t.trained for t in again.turns] == [True, False, True, True]
