"""Red team: data files in formats dsrecipes does not read (Arrow, CSV/TSV, plain text, gzip under a plain name, and
Parquet where it is not read: data=iterable) are one message naming the file, the formats read
and the conversion, at `validate`, at `train` and in every strategy's reader; before, they passed `validate` and every
row was a bad row (`invalid_utf8`) late in the run. data=map reads Parquet: tests/test_parquet_rows.py."""

from __future__ import annotations

import gzip
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.core.paths import SAMPLE_DATA_DIR

ROWS = [json.loads(line) for line in (SAMPLE_DATA_DIR / "train.jsonl").read_text().splitlines()[:40]]


def write(tmp_path: Path, kind: str) -> Path:
    """A file of `kind` holding (a few of) the sample's rows as a user would have it."""
    import pyarrow as pa

    table = pa.Table.from_pylist(ROWS)
    if kind == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, tmp_path / "train.parquet")
        return tmp_path / "train.parquet"
    if kind == "parquet_named_jsonl":  # the content decides, not the name
        import pyarrow.parquet as pq

        pq.write_table(table, tmp_path / "train.jsonl")
        return tmp_path / "train.jsonl"
    if kind == "arrow":  # what datasets' save_to_disk writes: an Arrow IPC stream
        with pa.OSFile(str(tmp_path / "data-00000-of-00001.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
        return tmp_path / "data-00000-of-00001.arrow"
    if kind in ("csv", "tsv"):
        sep = "," if kind == "csv" else "\t"
        path = tmp_path / f"train.{kind}"
        path.write_text("instruction" + sep + "output\n" + "".join(f"q{i}{sep}a{i}\n" for i in range(20)))
        return path
    if kind == "txt":
        path = tmp_path / "train.txt"
        path.write_text("".join(f"a line of plain text {i}\n" for i in range(20)))
        return path
    assert kind == "gzip_named_jsonl"
    path = tmp_path / "train.jsonl"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    return path


KINDS = {  # kind -> words the message must hold
    "parquet": "a Parquet file", "parquet_named_jsonl": "a Parquet file", "arrow": "an Arrow file",
    "csv": "a CSV file", "tsv": "a TSV file", "txt": "a plain-text file",
    "gzip_named_jsonl": "gzip-compressed, although its name does not end in .gz",
}


def one_error(capsys, path: Path, words: str) -> str:
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert f"{path}: {words}" in err and "invalid_utf8" not in err and "invalid_json" not in err, err
    assert ".jsonl" in err and ".json" in err, err  # the formats that are read
    return err


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_validate_names_a_file_of_another_format(kind, tmp_path, capsys):
    from dsrecipes.cli import main

    path = write(tmp_path, kind)
    strategy = ["data=iterable"] if kind.startswith("parquet") else []  # data=map reads Parquet
    assert main(["validate", "debug=fast", *strategy, f"dataset.sources=[{{name: a, paths: [{path}]}}]"]) == 2
    err = one_error(capsys, path, KINDS[kind])
    if kind in ("parquet", "csv", "tsv", "arrow"):
        assert "python -c" in err and str(path.with_suffix(".jsonl")) in err, err


def test_train_with_data_iterable_refuses_a_parquet_file_first(tmp_path, capsys, monkeypatch):
    """data=map and `dsrecipes shard` read Parquet (tests/test_parquet_rows.py); the stream's index of lines does
    not, and says which do."""
    from dsrecipes.cli import main

    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "parquet")
    argv = ["train", "debug=fast", "data=iterable", f"dataset.paths=[{path}]", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = one_error(capsys, path, "a Parquet file")
    assert "data=map" in err and "dsrecipes shard" in err, err


@pytest.mark.parametrize("strategy", ["map", "iterable", "presharded"])
def test_each_strategys_reader_refuses_it_where_it_opens_the_files(strategy, make_cfg, tmp_path):
    """Past `validate` (check_files=False: the file replaced after it, or a caller that skips it), the reader itself
    refuses the file under both bad-row policies, before reading a row."""
    from tests.test_data_malformed import read_through, settings

    path = write(tmp_path, "csv")
    for policy in ("error", "skip"):
        cfg = make_cfg(*settings(tmp_path, strategy, policy, str(path)), check_files=False)
        with pytest.raises(DataError) as err:
            read_through(strategy, cfg, tmp_path)
        (problem,) = err.value.problems
        assert problem.startswith(f"{path}: a CSV file, not rows dsrecipes reads"), problem


def test_the_conversion_it_prints_makes_a_file_that_validates(tmp_path, capsys):
    from dsrecipes.cli import main

    path = write(tmp_path, "parquet")
    overrides = ["debug=fast", "data=iterable", f"dataset.paths=[{path}]"]
    assert main(["validate", *overrides]) == 2
    command = re.search(r"convert it once: (python -c '[^']*')", capsys.readouterr().err).group(1)
    argv = shlex.split(command)
    subprocess.run([sys.executable, *argv[1:]], check=True, cwd=tmp_path, timeout=60)
    converted = path.with_suffix(".jsonl")
    assert [json.loads(line)["conversations"] for line in converted.read_text().splitlines()] == \
        [r["conversations"] for r in ROWS]
    assert main(["validate", "debug=fast", "data=iterable", f"dataset.paths=[{converted}]"]) == 0


def test_json_lines_under_a_csv_or_txt_name_are_still_read(tmp_path, capsys):
    from dsrecipes.cli import main

    for name in ("rows.csv", "rows.txt"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        assert main(["validate", "debug=fast", f"dataset.paths=[{tmp_path / name}]"]) == 0, capsys.readouterr().err
    bad = write(tmp_path, "csv")  # and CSV content under the same kind of name is refused
    assert main(["validate", "debug=fast", f"dataset.paths=[{bad}]"]) == 2
    one_error(capsys, bad, "a CSV file")


def test_an_object_in_a_store_is_judged_by_its_name_without_reading_it(monkeypatch):
    import dsrecipes.data.sources.files as files

    monkeypatch.setattr(files, "remote_expand", lambda pattern: ["s3://bucket/data/train-00000.parquet"])
    monkeypatch.setattr(files, "open_maybe_gzip", None)  # no byte of it is fetched
    with pytest.raises(DataError) as err:  # data=iterable's index (data=map reads it: tests/test_parquet_rows.py)
        files.expand_paths(["s3://bucket/data/*.parquet"], parquet=False)
    (problem,) = err.value.problems
    assert problem.startswith("s3://bucket/data/train-00000.parquet: a Parquet file") and "train-00000.jsonl" in problem
    assert files.expand_paths(["s3://bucket/data/*.parquet"])[0] == ["s3://bucket/data/train-00000.parquet"]


def test_a_llamafactory_folder_of_csv_files_says_so_and_one_of_parquet_files_is_read(tmp_path, capsys):
    """LLaMA-Factory's `file_name` may be a folder; one of CSV files was only 'holds no .json/.jsonl files'. One of
    Parquet files (as the Hub serves them) is read by data=map."""
    from dsrecipes.cli import main

    (tmp_path / "hub").mkdir()
    path = write(tmp_path / "hub", "csv")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "hub", "formatting": "alpaca"}}))
    argv = ["validate", "debug=fast", f"dataset.registry={tmp_path / 'dataset_info.json'}", "dataset.use=[mine]"]
    assert main(argv) == 2
    err = one_error(capsys, path, "a CSV file")
    assert "dataset.registry.mine: folder" in err and "python -c" in err, err
    path.unlink()
    write(tmp_path / "hub", "parquet")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "hub", "formatting": "sharegpt"}}))
    assert main(argv) == 0, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# A resume refused because dsrecipes's own preparation changed says so (not "file contents or preparation
# settings", which sent the user to their files). The checkpoint is written as a run writes it (complete.json,
# config.yaml, plan.json); the fingerprints are the map strategy's real keys, before and after PREP_VERSION moves.


def checkpoint(make_cfg, tmp_path: Path, *overrides: str, plan_record: str = "recorded"):
    """(cfg, tokenizer, ResumePlan) for a checkpoint at step 4 of a debug=fast run under this dsrecipes.
    `plan_record`: "recorded" (this version's plan.json), "none" (a plan.json of before the record was kept),
    "other" (the run plan of a later launch with other data, so not the checkpoint's), "deep" (no JSON to read)."""
    from dsrecipes.core.rundir import write_config
    from dsrecipes.core.runplan import ResumePlan
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.core.typed import config_to_dict
    from dsrecipes.run.entry import data_identity

    run = tmp_path / "run"
    cfg = make_cfg("debug=fast", f"data.cache_dir={tmp_path / 'cache'}", f"trainer.output_dir={run}", *overrides)
    tokenizer = load_tokenizer(cfg)
    fingerprint, files = data_identity(cfg, tokenizer)
    tag = run / "checkpoints" / "step_4"
    tag.mkdir(parents=True)
    write_config(tag, config_to_dict(cfg))
    (tag / "complete.json").write_text(json.dumps({"data_fingerprint": fingerprint, "data_files": files, "step": 4,
                                                   "world_size": 1, "total_steps": 8}))
    plan = {"data_fingerprint": fingerprint, "data_files": files}
    if plan_record != "none":
        from dsrecipes.data.prepare.cache import preparation_record

        plan["data_prepared"] = preparation_record(tokenizer)
    if plan_record == "other":
        plan["data_fingerprint"] = "0" * 24
    (run / "plan.json").write_text("[" * 100_000 if plan_record == "deep" else json.dumps(plan))
    return cfg, tokenizer, ResumePlan(str(tag), 4, 1, False)


def resume_refusal(cfg, resume, monkeypatch) -> str:
    """What `decide` (the launching process, before it writes anything) says when asked to resume `resume`: the
    checkpoint is found as `plan_resume` finds it (monkeypatched: its signature checks are other tests' concern)."""
    import dsrecipes.run.entry as entry
    from dsrecipes.core.errors import Refused

    monkeypatch.setattr(entry, "plan_resume", lambda *args, **kwargs: resume)
    with pytest.raises(Refused) as err:
        entry.decide(cfg)
    (problem,) = err.value.problems
    assert "training data: fingerprint" in problem, problem
    return problem


def test_a_resume_after_a_preparation_version_change_says_so(make_cfg, tmp_path, monkeypatch):
    import dsrecipes.data.prepare.cache as cache

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 4))
    cfg, _, resume = checkpoint(make_cfg, tmp_path, f"dataset.paths=[{data}]")
    monkeypatch.setattr(cache, "PREP_VERSION", cache.PREP_VERSION + 1)  # an upgrade that prepares differently
    problem = resume_refusal(cfg, resume, monkeypatch)
    old = cache.PREP_VERSION - 1
    assert f"the data was prepared by an earlier dsrecipes (preparation version {old}, now {old + 1})" in problem
    assert "file contents" not in problem and "Restore them" not in problem, problem
    assert "start a new run in another trainer.output_dir" in problem.lower(), problem
    assert "cannot resume" in problem and "these settings differ" not in problem, problem
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[::-1] * 4))  # and a changed file is still named
    problem = resume_refusal(cfg, resume, monkeypatch)
    assert f"({data} changed)" in problem and "Restore them to resume" in problem, problem


@pytest.mark.parametrize("plan_record", ["none", "other", "deep"])
def test_a_checkpoint_without_that_record_gets_both_possibilities(plan_record, make_cfg, tmp_path, monkeypatch):
    import dsrecipes.data.prepare.cache as cache

    cfg, _, resume = checkpoint(make_cfg, tmp_path, plan_record=plan_record)
    monkeypatch.setattr(cache, "PREP_VERSION", cache.PREP_VERSION + 1)
    problem = resume_refusal(cfg, resume, monkeypatch)
    assert "the training files and settings are unchanged" in problem, problem
    assert "an earlier dsrecipes prepared it" in problem and "does not record its preparation version" in problem
    assert "the tokenizer at model.path" in problem and "file contents" not in problem, problem


def test_a_changed_tokenizer_is_named_not_the_files(make_cfg, tmp_path, monkeypatch):
    import shutil

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    tok = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER_DIR, tok)
    cfg, _, resume = checkpoint(make_cfg, tmp_path, f"model.tokenizer_path={tok}")
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = "{#- a newer snapshot -#}" + config["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    problem = resume_refusal(cfg, resume, monkeypatch)
    assert "the tokenizer is not the one the checkpoint was prepared with" in problem, problem
    assert "file contents" not in problem and "preparation version" not in problem, problem



@pytest.mark.parametrize("strategy", ["iterable", "map"])
def test_a_stream_resumed_under_another_preparation_version_is_refused(strategy, make_cfg, tmp_path, monkeypatch):
    """data=iterable renders and tokenizes while it trains: its fingerprint hashes files and settings only, so an
    upgrade that renders differently (PREP_VERSION 4: weight-0 messages became context) resumed it silently on other
    tokens. The run plan's record now refuses it; map's own key already did (same words, checked alongside)."""
    import dsrecipes.data.prepare.cache as cache
    import dsrecipes.run.entry as entry
    from dsrecipes.core.errors import Refused

    cfg, _, resume = checkpoint(make_cfg, tmp_path, f"data={strategy}")
    monkeypatch.setattr(entry, "plan_resume", lambda *args, **kwargs: resume)
    entry.decide(cfg)  # same version: resumes (no refusal)
    monkeypatch.setattr(cache, "PREP_VERSION", cache.PREP_VERSION + 1)
    with pytest.raises(Refused) as err:
        entry.decide(cfg)
    (problem,) = err.value.problems
    old = cache.PREP_VERSION - 1
    assert f"by an earlier dsrecipes (preparation version {old}, now {old + 1})" in problem, problem
    assert "start a new run in another trainer.output_dir" in problem.lower() and "Restore them" not in problem
