"""Pins of behaviour that review refactors fold into one place: each test held before its refactor and must hold
after it, message for message."""

from __future__ import annotations

import json

import pytest

from dsrecipes.core.errors import UserError

# config.json -> (score's refusal after the directory, objective.reward_model's problem after the path); None: a scorer
SCORER_CASES = [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
     "a text-generating model (LlamaForCausalLM), not a reward model; dsrecipes score takes the export of an "
     "objective=reward run (a scalar score head)",
     "is a text-generating model (LlamaForCausalLM), not a reward model: its score head would be new and random, "
     "and so every reward; give an objective=reward export"),
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3},
     "a reward model has one label (a scalar score), this one has 3 (config.json; an objective=reward export has one)",
     "has 3 labels in config.json; a reward model has one (a scalar score): give an objective=reward export"),
    ({"architectures": ["LlamaForSequenceClassification"]},  # transformers' default: 2 labels
     "a reward model has one label (a scalar score), this one has 2 (config.json; an objective=reward export has one)",
     "has 2 labels in config.json; a reward model has one (a scalar score): give an objective=reward export"),
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": "one"},  # not a number: -1
     "a reward model has one label (a scalar score), this one has -1 (config.json; an objective=reward export has one)",
     "has -1 labels in config.json; a reward model has one (a scalar score): give an objective=reward export"),
    ({"architectures": ["LlamaForCausalLM"], "id2label": {"0": "a", "1": "b"}},  # a generator: named as one
     "a text-generating model (LlamaForCausalLM), not a reward model",
     "is a text-generating model (LlamaForCausalLM), not a reward model"),
    ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}, "num_labels": 2}, None, None),
    ({"architectures": ["LlamaForCausalLM"], "num_labels": 1}, None, None),  # one label: the head decides, not the name
    ({"num_labels": 1}, None, None),
]


def _model(tmp_path, config):
    model = tmp_path / "export"
    model.mkdir()
    (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")  # never read: judged before loading
    return model


@pytest.mark.parametrize("config,score,reward", SCORER_CASES, ids=[f"case{i}" for i in range(len(SCORER_CASES))])
def test_score_and_the_reward_model_judge_a_scorer_alike(tmp_path, config, score, reward):
    from dsrecipes.commands.score import check_model_dir
    from dsrecipes.objectives.rewards import reward_model_problems

    model = _model(tmp_path, config)
    if score is None:
        check_model_dir(model)
        assert reward_model_problems(str(model)) == []
        return
    _both_refuse(model, f"{model}: {score}", f"objective.reward_model: {model} {reward}")


def _both_refuse(model, score: str, reward: str) -> None:
    """dsrecipes score refuses `model` with a message starting `score`, objective.reward_model with `reward`."""
    from dsrecipes.commands.score import check_model_dir
    from dsrecipes.objectives.rewards import reward_model_problems

    with pytest.raises(UserError) as refused:
        check_model_dir(model)
    assert str(refused.value).startswith(score), str(refused.value)
    (problem,) = reward_model_problems(str(model))
    assert problem.startswith(reward), problem


@pytest.mark.parametrize("text,said", [("[1, 2]", "holds a list, not a model config (a JSON object)"),
                                       ("{not json", "not a readable JSON model config")])
def test_a_config_that_is_no_model_config_is_named_by_both(tmp_path, text, said):
    config = _model(tmp_path, text) / "config.json"
    _both_refuse(config.parent, f"{config}: {said}", f"objective.reward_model: {config}: {said}")


@pytest.mark.parametrize("config,arch", [
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3}, "LlamaForSequenceClassification"),
    ({"architectures": ["LlamaForCausalLM"], "num_labels": 1}, None),
    ({"architectures": ["LlamaForSequenceClassification", "LlamaForCausalLM"]}, None),
    ({"architectures": []}, None),
])
def test_chat_refuses_every_sequence_classifier(tmp_path, config, arch):
    """Chat / prompt-eval / the report ask another question than score: does it score instead of writing text (every
    architecture a sequence classifier), whatever its number of labels."""
    from dsrecipes.core.export_dir import scorer_architecture

    assert scorer_architecture(_model(tmp_path, config)) == arch


# --------------------------------------------------------------------------------------------------------------------
# dataset.val_size's share (data/sources/val_share.py), message for message

FEWER = "dataset.val_size=0.05 (a fraction), a smaller count, or 0 trains on more of them"
COUNTED = "counted in the dataset files"


def _rows_file(tmp_path, n: int, name: str = "mine.jsonl"):
    path = tmp_path / name
    path.write_text("".join(f'{{"conversations": [{{"from": "human", "value": "q{i}"}}]}}\n' for i in range(n)))
    return path


def _val_cfg(paths, val_size, **dataset):
    from dsrecipes.core.schema import TrainConfig

    cfg = TrainConfig()
    cfg.dataset.paths = [str(p) for p in paths]
    cfg.dataset.val_size = val_size
    for key, value in dataset.items():
        setattr(cfg.dataset, key, value)
    return cfg


@pytest.mark.parametrize("val_size,expected", [
    (0.5, ([], [f"dataset.val_size: 0.5 holds out 50 of at most 100 rows ({COUNTED}) for validation and trains on "
                f"at most 50; {FEWER}"])),
    (0.4, ([], [])),
    (64, ([], [f"dataset.val_size: 64 held out of at most 100 rows ({COUNTED}) leaves at most 36 to train on (64% "
               f"or more for validation); {FEWER}"])),
    (50, ([], [f"dataset.val_size: 50 held out of at most 100 rows ({COUNTED}) leaves at most 50 to train on (50% "
               f"or more for validation); {FEWER}"])),
    (49, ([], [])),
    (100, ([f"dataset.val_size: 100 validation samples leave nothing to train on (at most 100 rows, {COUNTED}); set "
            "dataset.val_size to a fraction (0.1), a count below 100, or 0 for no validation"], [])),
    (0, ([], [])),
])
def test_val_size_against_counted_rows(tmp_path, val_size, expected):
    from dsrecipes.data.sources.val_share import held_out

    assert held_out(_val_cfg([_rows_file(tmp_path, 100)], val_size)) == expected


def test_val_size_with_rows_unknown_bounded_or_unused(tmp_path):
    import gzip

    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.data.sources.val_share import held_out

    packed = tmp_path / "mine.jsonl.gz"
    packed.write_bytes(gzip.compress(_rows_file(tmp_path, 3).read_bytes()))  # gzip: not read, rows unknown
    assert held_out(_val_cfg([packed], 0.6)) == ([], [
        f"dataset.val_size: 0.6 holds out 60% of the rows for validation and trains on 40%; {FEWER}"])
    assert held_out(_val_cfg([packed], 0.4)) == ([], [])
    assert held_out(_val_cfg([packed], 64)) == ([], [])
    assert held_out(_val_cfg([packed], 64, max_samples=60)) == ([
        "dataset.val_size: 64 validation samples leave nothing to train on (at most 60 rows, dataset.max_samples); "
        "set dataset.val_size to a fraction (0.1), a count below 60, or 0 for no validation"], [])
    assert held_out(_val_cfg([_rows_file(tmp_path, 2)], 0.001)) == ([], [
        f"dataset.val_size: 0.001 holds out 1 of at most 2 rows ({COUNTED}) for validation and trains on at most 1; "
        f"{FEWER}"])
    capped = _val_cfg([_rows_file(tmp_path, 100)], 64, sources=[
        SourceConfig(name="more", paths=[str(_rows_file(tmp_path, 500, "more.jsonl"))], max_samples=20)])
    assert held_out(capped) == ([], [f"dataset.val_size: 64 held out of at most 120 rows ({COUNTED}, under the "
                                     f"sources' max_samples) leaves at most 56 to train on (53% or more for "
                                     f"validation); {FEWER}"])
    assert held_out(_val_cfg([_rows_file(tmp_path, 100)], 64, val_paths=[str(packed)])) == ([], [])


def test_val_share_counts_the_rows_of_small_local_files(tmp_path, monkeypatch):
    import gzip

    import dsrecipes.data.sources.val_share as val_share

    lines = tmp_path / "blank.jsonl"
    lines.write_bytes(b'\xef\xbb\xbf{"a": 1}\n\n   \n{"a": 2}\r\n{"a": 3}')  # BOM, blank lines, no final newline
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"a": i} for i in range(5)], indent=2))
    broken = tmp_path / "broken.json"
    broken.write_text('[{"a": 1}, {"a": ')
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    packed = tmp_path / "rows.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"a": 1}\n'))
    assert val_share._counted([str(lines)]) == 3
    assert val_share._counted([str(array)]) == 5
    assert val_share._counted([str(lines), str(array), str(empty)]) == 8
    assert val_share._counted([str(tmp_path / "*.jsonl")]) == 3  # a glob: blank.jsonl and empty.jsonl
    assert val_share._counted([str(broken)]) is None
    assert val_share._counted([str(packed)]) is None
    assert val_share._counted([str(tmp_path / "none-*.jsonl")]) is None
    assert val_share._counted(["https://example.com/rows.jsonl"]) is None
    monkeypatch.setattr(val_share, "COUNT_BYTES", lines.stat().st_size - 1)
    assert val_share._counted([str(lines)]) is None


def test_val_share_reads_no_parquet_file(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    import dsrecipes.data.sources.val_share as val_share

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"a": [1, 2, 3]}), path)
    assert val_share._counted([str(path)]) is None


# --------------------------------------------------------------------------------------------------------------------
# The walks of an Arrow schema in data/sources/parquet_rows.py, answer for answer

def _arrow_types():
    pa = pytest.importorskip("pyarrow")
    turn = pa.struct([("from", pa.string()), ("value", pa.string()), ("weight", pa.float64())])
    return pa, {
        "string": pa.string(), "large_string": pa.large_string(), "int": pa.int64(), "bool": pa.bool_(),
        "null": pa.null(), "f32": pa.float32(), "f16": pa.float16(), "bytes": pa.binary(), "ts": pa.timestamp("s"),
        "dict": pa.dictionary(pa.int32(), pa.string()), "turns": pa.list_(turn), "large": pa.large_list(turn),
        "fixed": pa.list_(pa.int64(), 3), "empty_struct": pa.struct([]), "map": pa.map_(pa.string(), pa.int64()),
        "deep": pa.list_(pa.list_(pa.struct([("x", pa.list_(pa.dictionary(pa.int8(), pa.string())))]))),
        "odd_inside": pa.list_(pa.struct([("when", pa.date32())])), "list_of_dict": pa.list_(pa.dictionary(
            pa.int8(), pa.large_string())), "struct_of_lists": pa.struct([("a", pa.list_(pa.int8())), ("b", turn)]),
    }


def test_the_arrow_schema_walks_answer_as_before():
    from dsrecipes.data.sources import parquet_rows

    pa, kinds = _arrow_types()
    got = {name: (parquet_rows._depth(k), parquet_rows._has_struct(k), parquet_rows._jsonable(k))
           for name, k in kinds.items()}
    assert got == {
        "string": (0, False, True), "large_string": (0, False, True), "int": (0, False, True), "bool": (0, False, True),
        "null": (0, False, True), "f32": (0, False, True), "f16": (0, False, False), "bytes": (0, False, False),
        "ts": (0, False, False), "dict": (0, False, True), "turns": (2, True, True), "large": (2, True, True),
        "fixed": (1, False, True), "empty_struct": (1, True, True), "map": (0, False, False), "deep": (4, True, True),
        "odd_inside": (2, True, False), "list_of_dict": (1, False, True), "struct_of_lists": (2, True, True),
    }, got
    schema = pa.schema([("conversations", kinds["turns"]), ("deep", kinds["deep"]), ("plain", pa.string()),
                        ("s", kinds["struct_of_lists"])])
    assert sorted(parquet_rows._names(schema)) == sorted(["conversations", "from", "value", "weight", "deep", "x",
                                                          "plain", "s", "a", "b", "from", "value", "weight"])
    array = pa.array([[{"from": "a", "value": "b", "weight": None}]], type=kinds["turns"])
    assert [str(a.type) for a in parquet_rows._nested(array)] == [
        str(kinds["turns"]), str(kinds["turns"].value_type), "double", "string", "string"]
