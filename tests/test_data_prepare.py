"""prepare()/load_prepared(): splits, mixing weights, packing, cache reuse and invalidation, bad-row policy."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.core.paths import TINY_TOKENIZER_DIR
from dsrecipes.core.schema import BadRows, DatasetFormat, SourceConfig
from dsrecipes.data.prepare.build import load_prepared, prepare

FIX = Path(__file__).parent / "fixtures" / "data"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


@pytest.fixture(scope="module")
def base_cfg():
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(["dataset.max_samples=300", "dataset.val_size=20"])  # composed once: Hydra is slow


def variant(base, **changes):
    """A copy of `base` with dotted fields changed: variant(cfg, **{"data.packing": True})."""
    cfg = copy.deepcopy(base)
    for dotted, value in changes.items():
        *parents, name = dotted.split(".")
        node = cfg
        for p in parents:
            node = getattr(node, p)
        setattr(node, name, value)
    return cfg


@pytest.fixture
def cfg_for(base_cfg, tmp_path):
    def _cfg(**changes):
        return variant(base_cfg, **{"data.cache_dir": str(tmp_path / "cache"), **changes})

    return _cfg


def all_ids(ds) -> list:
    return [i for row in ds["ids"] for i in row]


def test_prepare_splits_writes_stats_and_reuses_cache(cfg_for, tok, tmp_path):
    cfg = cfg_for()
    first = prepare(cfg, tok, tmp_path / "run1")
    assert (len(first.train), len(first.val)) == (280, 20)
    assert set(first.train.column_names) == {"ids", "input_ids", "labels", "position_ids"}
    stats = json.loads((tmp_path / "run1" / "prepare_stats.json").read_text())
    assert stats["rows_read"] == 300 and stats["rows_kept"] == 300 and stats["skipped_total"] == 0
    assert stats["cache_hit"] is False and 0.1 < stats["trained_token_share"] < 0.6
    assert sum(n for _, _, n in stats["length"]["histogram"]) == 300
    assert not set(all_ids(first.train)) & set(all_ids(first.val))
    assert len(set(all_ids(first.train) + all_ids(first.val))) == 300
    again = prepare(cfg, tok, tmp_path / "run2")
    assert again.stats["cache_hit"] is True and again.cache_dir == first.cache_dir
    assert all_ids(again.train) == all_ids(first.train)
    on_rank = load_prepared(cfg, tmp_path / "run1")
    assert on_rank.train["input_ids"][:5] == first.train["input_ids"][:5] and len(on_rank.val) == 20


def test_val_split_depends_on_seed_only(cfg_for, tok, tmp_path):
    def val(**changes):
        return all_ids(prepare(cfg_for(**changes), tok, tmp_path / "r").val)

    assert val(**{"trainer.seed": 1}) == val(**{"trainer.seed": 1, "data.cutoff_len": 256})
    assert val(**{"trainer.seed": 1}) != val(**{"trainer.seed": 2})
    assert len(val(**{"dataset.val_size": 0.1})) == 30
    assert prepare(cfg_for(**{"dataset.val_size": 0.0}), tok, tmp_path / "r").val is None
    with pytest.raises(DataError, match=r"dataset.val_size: 300 validation samples leave nothing to train on \(300 "
                       r"usable samples\); set dataset.val_size to a fraction \(0.1\), a count below 300, or 0"):
        prepare(cfg_for(**{"dataset.val_size": 300.0}), tok, tmp_path / "r")


def test_a_validation_split_of_most_of_the_data_gets_a_note():
    """The default val_size (64, the bundled sample's) takes 64 of a 100-row file of one's own: said, with the fix;
    validation files (dataset.val_paths) or a small share: nothing."""
    from dsrecipes.data.prepare.stats import _val_share_note

    def note(train, val, sources=()):
        return _val_share_note({"samples": {"train": train, "val": val}, "sources": dict.fromkeys(sources, {})})

    (line,) = note(36, 64)
    assert "holds out 64 of 100 samples (64%)" in line and "dataset.val_size=0.05" in line, line
    assert note(2936, 64) == note(75, 25) == note(10, 0) == [] and note(36, 64, ["dataset.val_paths"]) == []


def files(*paths, **changes):
    return {"dataset.paths": [str(p) for p in paths], "dataset.val_size": 0.0, "dataset.max_samples": None, **changes}


SKIP = {"dataset.bad_rows": BadRows.skip, "dataset.max_bad_fraction": 1.0}


def test_changed_input_invalidates_cache(cfg_for, tok, tmp_path):
    data = tmp_path / "d.jsonl"
    shutil.copyfile(FIX / "bad_rows.jsonl", data)
    cfg = cfg_for(**files(data, **SKIP))
    first = prepare(cfg, tok, tmp_path / "run")
    with open(data, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"conversations": [{"from": "human", "value": "new"}, {"from": "gpt", "value": "row"}]}) + "\n")
    second = prepare(cfg, tok, tmp_path / "run")
    assert second.cache_dir != first.cache_dir and second.stats["cache_hit"] is False
    assert len(second.train) == len(first.train) + 1 and "d.jsonl:18" in all_ids(second.train)


def test_skip_policy_quarantine_and_accounting(cfg_for, tok, tmp_path):
    cfg = cfg_for(**files(FIX / "bad_rows.jsonl", FIX / "empty.jsonl", **SKIP))
    prep = prepare(cfg, tok, tmp_path / "run")
    st = prep.stats
    assert st["skipped"]["bad_value"] == 3 and st["skipped"]["empty_file"] == 1 and st["skipped_total"] == 14
    assert st["rows_read"] == st["rows_kept"] + st["skipped_total"] + st["dropped_all_trained_cut"]  # nothing silent
    assert st["trailing_turns_dropped"] == 1
    lines = (tmp_path / "run" / "quarantine.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 14 and json.loads(lines[0])["reason"] == "invalid_json"
    again = prepare(cfg, tok, tmp_path / "run2")  # a cache hit still leaves the quarantine in the run dir
    assert again.stats["cache_hit"] and (tmp_path / "run2" / "quarantine.jsonl").read_text(encoding="utf-8").splitlines() == lines
    strict = cfg_for(**files(FIX / "bad_rows.jsonl", **{**SKIP, "dataset.max_bad_fraction": 0.5}))
    with pytest.raises(DataError, match="13 of 16 rows are bad") as err:
        prepare(strict, tok, tmp_path / "run3")
    assert str(tmp_path / "run3" / "quarantine.jsonl") in str(err.value)  # kept for the user to look at
    assert len((tmp_path / "run3" / "quarantine.jsonl").read_text(encoding="utf-8").splitlines()) == 13
    error = cfg_for(**files(FIX / "bad_rows.jsonl"))
    with pytest.raises(DataError, match=r"bad_rows.jsonl:2: invalid_json"):
        prepare(error, tok, tmp_path / "run4")


def test_mixing_weights_copy_and_subsample(cfg_for, tok, tmp_path):
    sources = [SourceConfig(name="arr", paths=[str(FIX / "array.json")], weight=2.5),
               SourceConfig(name="alp", paths=[str(FIX / "alpaca.json")], format=DatasetFormat.alpaca, weight=0.5)]
    cfg = cfg_for(**files(FIX / "small.jsonl.gz", **SKIP, **{"dataset.sources": sources}))
    prep = prepare(cfg, tok, tmp_path / "run")
    ids = all_ids(prep.train)
    assert len(ids) == len(set(ids))  # copies get their own ids
    by_source = Counter(i.split(":")[0].split("@")[0] for i in ids)
    assert by_source["small.jsonl.gz"] == 4  # weight 1
    arr = sorted(i for i in ids if i.startswith("array.json"))  # 2 rows * 2.5: two full copies + one seeded extra
    assert arr[:2] == ["array.json:0", "array.json:0@1"] and len(arr) == 5
    assert {"array.json:1", "array.json:1@1"} <= set(arr) and len([i for i in arr if i.endswith("@2")]) == 1
    assert len([i for i in ids if i == "7" or i.startswith("alpaca.json")]) == 1  # 2 rows * 0.5
    assert prep.stats["sources"]["arr"]["train_samples"] == 5
    assert all_ids(prepare(cfg, tok, tmp_path / "run").train) == ids  # deterministic


def test_packing_rows_and_efficiency(cfg_for, tok, tmp_path):
    plain = prepare(cfg_for(), tok, tmp_path / "a")
    packed = prepare(cfg_for(**{"data.packing": True, "data.cutoff_len": 256}), tok, tmp_path / "b")
    assert sorted(all_ids(packed.train)) == sorted(all_ids(plain.train))
    assert packed.stats["packing_efficiency"]["train"] >= 0.95
    assert len(packed.train) < len(plain.train) / 3
    row = packed.train[0]
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
    assert len(starts) == len(row["ids"]) and len(row["input_ids"]) <= 256
    assert all(row["labels"][s] == -100 for s in starts)
    with pytest.raises(DataError, match="prepared with data.packing=True"):
        load_prepared(cfg_for(**{"data.cutoff_len": 256}), tmp_path / "b")


@pytest.mark.parametrize("packing", [False, True])
def test_every_row_holds_its_samples_tokens(cfg_for, tok, tmp_path, packing):
    """Rows (train and validation, packed or not) are exactly the Encoder's samples, by id, in row order."""
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.sharegpt import iter_conversations

    cfg = cfg_for(**{"data.packing": packing, "data.cutoff_len": 256})
    prep = prepare(cfg, tok, tmp_path / "run")
    convs = iter_conversations(cfg.dataset, report=BadRowReport(cfg.dataset.bad_rows, 1.0))
    by_id = {e.id: e for e in Encoder(tok, cfg).encode_batch(list(convs)) if e is not None}
    for split in (prep.train, prep.val):
        for row in split:
            samples = [by_id[i] for i in row["ids"]]
            assert row["input_ids"] == [t for e in samples for t in e.input_ids]
            want = [lab for e in samples for lab in ([-100] + e.labels[1:] if packing else e.labels)]
            assert row["labels"] == want
            assert row["position_ids"] == [p for e in samples for p in range(len(e.input_ids))]


def test_parallel_workers_give_identical_output(cfg_for, tok, tmp_path):
    base = {"dataset.max_samples": 1200, "dataset.val_size": 0.0}
    one = prepare(cfg_for(**base, **{"data.cache_dir": str(tmp_path / "c1")}), tok, tmp_path / "r1")
    two = prepare(cfg_for(**base, **{"data.cache_dir": str(tmp_path / "c2"), "data.preprocess_workers": 2}), tok, tmp_path / "r2")
    assert one.train["input_ids"] == two.train["input_ids"] and one.train["labels"] == two.train["labels"]
    assert all_ids(one.train) == all_ids(two.train)


def test_load_prepared_without_prepare(cfg_for, tmp_path):
    with pytest.raises(DataError, match="prepare_stats.json: missing"):
        load_prepared(cfg_for(), tmp_path / "nothing")


@pytest.mark.parametrize("packing", [False, True])
def test_splits_read_without_datasets_give_what_datasets_gives(cfg_for, tok, tmp_path, packing):
    """Ranks read a prepared split with pyarrow alone (data/prepare/arrow_rows.py): every row, column, batch, selection and
    the iteration order are the values `datasets.load_from_disk` gives for the same directory."""
    from datasets import load_from_disk

    from dsrecipes.data.prepare.arrow_rows import ArrowRows

    prep = prepare(cfg_for(**{"data.packing": packing, "data.cutoff_len": 256}), tok, tmp_path / "run")
    assert isinstance(prep.train, ArrowRows) and isinstance(prep.val, ArrowRows)
    for split in ("train", "val"):
        ours, theirs = getattr(prep, split), load_from_disk(str(prep.cache_dir / split))
        assert len(ours) == len(theirs) and ours.column_names == theirs.column_names
        assert list(ours) == list(theirs)
        last = len(ours) - 1
        assert len(ours) > 1 and [ours[i] for i in (0, last, -1)] == [theirs[i] for i in (0, last, -1)]
        assert ours.__getitems__([last, 0, last]) == [theirs[last], theirs[0], theirs[last]]
        assert all(ours[c] == list(theirs[c]) for c in theirs.column_names)
        assert list(ours.select(range(4))) == list(theirs.select(range(4)))
        with pytest.raises(IndexError):
            ours[len(ours)]


def test_reading_a_split_imports_neither_datasets_nor_pandas(cfg_for, tok, tmp_path):
    """What a rank does with a split (open, length, a batch, a row, a column, iterate) imports neither `datasets` nor
    pandas (pyarrow's `pa.array` would import pandas to ask whether its input is a pandas object: 0.36-0.45 CPU s
    in every rank). Checked in a fresh interpreter, where nothing else has imported them."""
    prep = prepare(cfg_for(), tok, tmp_path / "run")
    code = (
        "import sys\n"
        "from dsrecipes.data.prepare.arrow_rows import ArrowRows\n"
        f"rows = ArrowRows.open({str(prep.cache_dir / 'train')!r})\n"
        "assert len(rows.__getitems__([len(rows) - 1, 0])) == 2 and rows[0] and rows['input_ids'] and list(rows)\n"
        "assert list(rows.select([1])) == [rows[1]]\n"
        "print(sorted(m for m in ('pandas', 'datasets') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_a_damaged_prepared_split_is_one_message(cfg_for, tok, tmp_path):
    from dsrecipes.data.prepare.arrow_rows import ArrowRows

    prep = prepare(cfg_for(), tok, tmp_path / "run")
    split = tmp_path / "copy"
    shutil.copytree(prep.cache_dir / "train", split)
    (arrow,) = split.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[:100])  # cut short (a full disk, a copy interrupted)
    with pytest.raises(DataError, match="copy: not a readable prepared split"):
        ArrowRows.open(split)
    (split / "state.json").write_text("{}")
    with pytest.raises(DataError, match="not a readable prepared split"):
        ArrowRows.open(split)
