"""Every strategy evaluates (issue 22): `data=map` reads `dataset.val_paths`, `data=presharded` a validation part
(`dsrecipes shard --val-size N`) or `dataset.val_paths`, and `trainer.eval_every` with no validation data is a note.

Loader-level checks build the run directory the way the launching process does (tests/helpers/launching.py) and
read what each rank would evaluate; two real one-rank runs (`python -m dsrecipes`, local launcher) log eval losses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError, UserError
from dsrecipes.core.paths import SAMPLE_DATA_DIR
from dsrecipes.data.shard.build import VAL_PART, read_manifest
from tests.conftest import in_process_environ
from tests.helpers.launching import plan_like_launcher

LINES = (SAMPLE_DATA_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines()


def write_rows(path: Path, lines, prefix: str) -> set:
    """JSONL rows with explicit ids `<prefix>-<k>`; returns the ids."""
    rows = [dict(json.loads(x), id=f"{prefix}-{k}") for k, x in enumerate(lines)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return {r["id"] for r in rows}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("valdata")
    train = write_rows(root / "train.jsonl", LINES[:80], "train")
    val = write_rows(root / "val.jsonl", LINES[100:111], "val")
    return root, train, val


def rank_ids(cfg, tok, run_dir, plan, world):
    """(training ids of every rank's first epoch, validation ids of every rank) as the ranks would read them."""
    from dsrecipes.data.strategies import build_loaders

    trained, evaluated = [], []
    for rank in range(world):
        train, ev = build_loaders(cfg, tok, rank, world, run_dir, plan)
        trained += [i for b in train for i in b["ids"]]
        evaluated += [] if ev is None else [i for b in ev for i in b["ids"]]
    return trained, evaluated


def test_map_evaluates_every_row_of_val_paths_and_trains_on_none(make_cfg, files, tmp_path):
    from dsrecipes.core.tokenizer import load_tokenizer

    root, train_ids, val_ids = files
    cfg = make_cfg(f"dataset.paths=[{root / 'train.jsonl'}]", f"dataset.val_paths=[{root / 'val.jsonl'}]",
                   "dataset.val_size=5", "dataset.max_samples=40", f"data.cache_dir={tmp_path / 'c'}",
                   "trainer.micro_batch_size=4")
    plan = plan_like_launcher(cfg, tmp_path / "run", 2)
    assert plan.rows == 40  # dataset.max_samples caps training rows only; val_size is unused with val_paths
    trained, evaluated = rank_ids(cfg, load_tokenizer(cfg), tmp_path / "run", plan, 2)
    assert sorted(evaluated) == sorted(val_ids)  # all 11 rows, each on one rank
    assert set(trained) <= train_ids and len(trained) == len(set(trained))
    stats = json.loads((tmp_path / "run" / "prepare_stats.json").read_text(encoding="utf-8"))
    assert stats["samples"] == {"train": 40, "val": 11}

    # an edited validation file is a new preparation, never the cached one
    write_rows(root / "val2.jsonl", LINES[100:105], "val")
    os.replace(root / "val2.jsonl", root / "val.jsonl")
    plan = plan_like_launcher(cfg, tmp_path / "run2", 1)
    assert len(rank_ids(cfg, load_tokenizer(cfg), tmp_path / "run2", plan, 1)[1]) == 5


def test_map_refuses_a_validation_file_that_is_also_trained_on(make_cfg, files, tmp_path):
    root, _, _ = files
    cfg = make_cfg(f"dataset.paths=[{root / 'train.jsonl'}]", f"dataset.val_paths=[{root / '.' / 'train.jsonl'}]",
                   f"data.cache_dir={tmp_path / 'c'}")
    with pytest.raises(DataError, match="is the same file as the training file"):
        plan_like_launcher(cfg, tmp_path / "run", 1)


@pytest.fixture(scope="module")
def val_shard(files, tmp_path_factory):
    """2 parts plus a validation part of 10 samples, through the CLI."""
    from dsrecipes.cli import main

    root, _, _ = files
    out = tmp_path_factory.mktemp("shards") / "parts"
    assert main(["shard", str(root / "train.jsonl"), "--parts", "2", "--out", str(out), "--val-size", "10",
                 f"data.cache_dir={root / 'c'}"]) == 0
    return out


def test_shard_holds_a_validation_part_out_of_the_parts(val_shard, files):
    _, train_ids, _ = files
    m = read_manifest(str(val_shard), world_size=2)
    part_ids = [json.loads(x)["id"] for r in range(2) for x in Path(m.part_path(r)).read_text().splitlines()]
    held = [json.loads(x)["id"] for x in (val_shard / VAL_PART).read_text().splitlines()]
    assert m.val_file == VAL_PART and m.val_count == len(held) == 10 and m.counts == [35, 35]
    assert sorted(part_ids + held) == sorted(train_ids) and not set(part_ids) & set(held)
    assert held != [f"train-{k}" for k in range(10)]  # a seeded choice (kept in data order), not the first rows


def test_shard_refuses_a_bad_val_size(files, tmp_path):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.shard.build import shard

    root, _, _ = files
    cfg = compose_and_load([f"dataset.paths=[{root / 'train.jsonl'}]"])
    with pytest.raises(UserError, match="--val-size: a fraction in"):
        shard(cfg, 2, str(tmp_path / "o"), val_size=2.5)


def test_presharded_evaluates_the_validation_part(make_cfg, val_shard, tmp_path, capsys):
    from dsrecipes.core.tokenizer import load_tokenizer

    cfg = make_cfg("data=presharded", f"data.shard_dir={val_shard}", "trainer.micro_batch_size=4")
    plan = plan_like_launcher(cfg, tmp_path / "run", 2)
    assert "note: trainer.eval_every" not in capsys.readouterr().err
    held = {json.loads(x)["id"] for x in (val_shard / VAL_PART).read_text().splitlines()}
    trained, evaluated = rank_ids(cfg, load_tokenizer(cfg), tmp_path / "run", plan, 2)
    assert sorted(evaluated) == sorted(held) and not set(trained) & held


def test_presharded_val_paths_win_over_the_validation_part(make_cfg, val_shard, files, tmp_path):
    from dsrecipes.core.tokenizer import load_tokenizer

    root, _, val_ids = files
    write_rows(root / "val.jsonl", LINES[100:111], "val")  # (an earlier test may have edited it)
    cfg = make_cfg("data=presharded", f"data.shard_dir={val_shard}", f"dataset.val_paths=[{root / 'val.jsonl'}]",
                   "trainer.micro_batch_size=4")
    plan = plan_like_launcher(cfg, tmp_path / "run", 2)
    assert sorted(rank_ids(cfg, load_tokenizer(cfg), tmp_path / "run", plan, 2)[1]) == sorted(val_ids)


def test_a_modified_validation_part_is_refused(make_cfg, val_shard, tmp_path):
    import shutil

    copy = tmp_path / "parts"
    shutil.copytree(val_shard, copy)
    cfg = make_cfg("data=presharded", f"data.shard_dir={copy}", "trainer.micro_batch_size=4")
    plan = plan_like_launcher(cfg, tmp_path / "run", 2)
    with open(copy / VAL_PART, "a", encoding="utf-8") as fh:
        fh.write(LINES[0] + "\n")
    from dsrecipes.data.strategies import build_loaders

    with pytest.raises(DataError, match="val.jsonl: sha256 differs"):
        build_loaders(cfg, None, 0, 2, tmp_path / "run", plan)


@pytest.mark.parametrize("kind", ["map", "presharded"])
def test_eval_every_without_validation_data_is_a_note_printed_once(kind, make_cfg, files, tmp_path, capsys):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.shard.build import shard

    root, _, _ = files
    data = [f"dataset.paths=[{root / 'train.jsonl'}]", f"data.cache_dir={tmp_path / 'c'}"]
    if kind == "presharded":
        shard(compose_and_load(data), 1, str(tmp_path / "parts"))  # no --val-size
        data = ["data=presharded", f"data.shard_dir={tmp_path / 'parts'}"]
    capsys.readouterr()
    plan_like_launcher(make_cfg(*data, "dataset.val_size=0", "trainer.eval_every=3"), tmp_path / "run", 1)
    err = capsys.readouterr().err
    assert err.count("note: trainer.eval_every=3, but this run has no validation data") == 1, err
    plan_like_launcher(make_cfg(*data, "dataset.val_size=0", "trainer.eval_every=0"), tmp_path / "run0", 1)
    assert "note: trainer.eval_every" not in capsys.readouterr().err  # 0: only at the end; nothing was asked


# ---------------------------------------------------------------------------------------------------------------
# Real runs: one rank each, in this process (launcher=local)


def run_and_read_evals(run_dir: Path, *overrides: str):
    from dsrecipes.cli import main
    from dsrecipes.core.rundir import read_metrics

    with in_process_environ():
        assert main(["debug=fast", "trainer.max_steps=4", "trainer.eval_every=2", "trainer.save_every=0",
                     "launcher=local", f"trainer.output_dir={run_dir}", f"hydra.run.dir={run_dir}", *overrides]) == 0
    return {r["step"]: r["eval_loss"] for r in read_metrics(run_dir) if "eval_loss" in r}


@pytest.mark.slow
def test_real_runs_evaluate_map_val_paths_and_a_presharded_validation_part(files, val_shard, tmp_path):
    import math

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.shard.build import shard

    root, _, _ = files
    write_rows(root / "val.jsonl", LINES[100:111], "val")
    evals = run_and_read_evals(tmp_path / "map", f"dataset.paths=[{root / 'train.jsonl'}]",
                               f"dataset.val_paths=[{root / 'val.jsonl'}]", f"data.cache_dir={tmp_path / 'c'}")
    assert sorted(evals) == [0, 2, 4] and all(math.isfinite(v) for v in evals.values())
    stats = json.loads((tmp_path / "map" / "prepare_stats.json").read_text(encoding="utf-8"))
    assert stats["samples"]["val"] == 11  # the evaluated rows are the validation file's, all of them

    shard(compose_and_load([f"dataset.paths=[{root / 'train.jsonl'}]", f"data.cache_dir={tmp_path / 'c'}"]), 1,
          str(tmp_path / "one"), val_size=8)  # one rank: one part (+ the validation part)
    evals = run_and_read_evals(tmp_path / "pre", "data=presharded", f"data.shard_dir={tmp_path / 'one'}",
                               f"data.cache_dir={tmp_path / 'c'}")
    assert sorted(evals) == [0, 2, 4] and all(math.isfinite(v) for v in evals.values())
    assert read_manifest(str(tmp_path / "one")).val_count == 8
