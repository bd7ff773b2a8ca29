"""Leftovers (third batch): the sweep table's `(earlier)` from what the sweep skipped, absolute paths in the "train
further" command, LLaMA-Factory entries naming one file, stale export staging directories, `step_N.replaced`."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.test_walk5 import _earlier_sweep

# ---------------------------------------------------------------------------------------------------------------
# 1. The sweep table's `(earlier)`: the jobs this run of the sweep skipped, never a file's time


def _job(sw, n):
    from omegaconf import OmegaConf

    return OmegaConf.create({"hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(sw)},
                                       "runtime": {"output_dir": str(sw / str(n))}}})  # fmt: skip


def test_the_sweep_table_marks_the_skipped_job_earlier_whatever_the_clocks_say(tmp_path, capsys):
    """Was: `(earlier)` meant 'result.json older than the start of this run of the sweep': a skipped job whose file
    time is ahead of the clock (another machine's, a restored copy) was listed as run now, a job run now whose file
    time lags was listed `(earlier)`. Now the jobs the command skipped (FINISHED_EARLIER, Hydra's job return)."""
    from hydra.core.utils import JobReturn, JobStatus

    from dsrecipes.observe import sweep

    sw = _earlier_sweep(tmp_path / "sw", [["zero=stage0"], ["zero=stage1"]])
    future, past = time.time() + 3600, time.time() - 7200
    os.utime(sw / "0" / "result.json", (future, future))  # skipped now, its file time ahead of the clock
    (sw / "1" / "result.json").write_text(json.dumps({"status": "ok", "error": None, "final_loss": 0.5}))  # run now
    os.utime(sw / "1" / "result.json", (past, past))  # ... its file time behind it
    callback = sweep.SweepSummary()
    callback.on_multirun_start(config=None)
    callback.on_job_end(_job(sw, 0), JobReturn(status=JobStatus.COMPLETED, _return_value=sweep.FINISHED_EARLIER))
    callback.on_job_end(_job(sw, 1), JobReturn(status=JobStatus.COMPLETED, _return_value=None))
    callback.on_multirun_end(_job(sw, 1))
    out = capsys.readouterr().out
    assert "| 0 | stage0 | ok (earlier) |" in out and "| 1 (best) | stage1 | ok |" in out, out
    jobs = json.loads((sw / "summary.json").read_text())["jobs"]
    assert [(j["job"], j["earlier"]) for j in jobs] == [("0", True), ("1", False)]


def test_a_sweep_job_returns_finished_earlier_only_when_the_command_skipped_it(monkeypatch):
    from dsrecipes.commands import train
    from dsrecipes.observe.sweep import FINISHED_EARLIER

    inv = train.Invocation([], sweep=True)
    monkeypatch.setattr(train, "run_job", lambda inv, job: None)  # ran (or failed): not skipped
    assert train.sweep_job(inv, None) is None
    monkeypatch.setattr(train, "run_job", lambda inv, job: inv.done_earlier.append("/runs/0"))
    assert train.sweep_job(inv, None) == FINISHED_EARLIER


# ---------------------------------------------------------------------------------------------------------------
# 2. The "train further" command names dataset.val_paths (and the launcher's local files) absolute


def test_the_train_further_command_names_validation_files_absolute(tmp_path, monkeypatch):
    """Was: `dataset.val_paths=[data/val.jsonl]` was repeated as typed (config.yaml recorded it so and the resume
    contract compared it), so the command pointed elsewhere when typed from another directory."""
    import shlex

    from dsrecipes.observe.report import resume_command

    monkeypatch.chdir(tmp_path)
    typed = ["dataset.paths=[data/a.jsonl]", "dataset.val_paths=[data/val.jsonl,'s3://b/v.jsonl']",
             "launcher.hostfile=hosts", "offload.nvme_path=nvme"]  # fmt: skip
    command = shlex.split(resume_command(tmp_path / "runs" / "ft", typed, 8, 8))
    assert f"dataset.val_paths=[{tmp_path / 'data' / 'val.jsonl'},'s3://b/v.jsonl']" in command, command
    assert f"launcher.hostfile={tmp_path / 'hosts'}" in command and f"offload.nvme_path={tmp_path / 'nvme'}" in command


def test_a_run_records_its_validation_files_absolute_as_it_does_its_training_files(tmp_path, monkeypatch):
    """The absolute form the command repeats is what config.yaml records: the resume contract sees no change."""
    import dataclasses

    from dsrecipes.config.defaults import with_derived_defaults
    from dsrecipes.core.schema import TrainConfig

    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, val_paths=["v.jsonl", "s3://b/v.jsonl"]))
    assert with_derived_defaults(cfg).dataset.val_paths == [str(tmp_path / "v.jsonl"), "s3://b/v.jsonl"]


@pytest.mark.slow
def test_the_printed_command_with_validation_files_resumes_from_another_directory(tmp_path, capsys, monkeypatch):
    """A real run with relative dataset.paths and dataset.val_paths; its printed command typed from another
    directory resumes (was: val_paths relative, 'matches no file' there)."""
    import shlex

    from dsrecipes.cli import main as cli_main
    from tests.conftest import in_process_environ
    from tests.test_walk4 import SFT_ROW

    (tmp_path / "data").mkdir()
    for name, n in (("mine.jsonl", 24), ("val.jsonl", 4)):
        rows = "".join(json.dumps({**SFT_ROW, "id": f"{name}{i}"}) + "\n" for i in range(n))
        (tmp_path / "data" / name).write_text(rows)
    monkeypatch.chdir(tmp_path)
    run = ["train", "debug=fast", "dataset=sharegpt_files", "dataset.paths=[data/mine.jsonl]",
           "dataset.val_paths=[data/val.jsonl]", "trainer.max_steps=1", "trainer.eval_every=0", "trainer.export=false",
           "trainer.output_dir=runs/ft", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    with in_process_environ():
        assert cli_main(run) == 0
    further = [line for line in capsys.readouterr().out.splitlines() if "train further:" in line]
    assert len(further) == 1 and f"dataset.val_paths=[{tmp_path / 'data' / 'val.jsonl'}]" in further[0], further
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with in_process_environ():
        assert cli_main(shlex.split(further[0].split("train further:", 1)[1])[1:]) == 0
    assert json.loads((tmp_path / "runs" / "ft" / "result.json").read_text())["steps"] == 2


# ---------------------------------------------------------------------------------------------------------------
# 3. Two LLaMA-Factory entries naming one file: refused, not one of them dropped


def _lf_registry(tmp_path, entries):
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "rows.json").write_text(json.dumps([{"instruction": "hi", "output": "hello"}]))
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(entries))
    return str(tmp_path / "data" / "dataset_info.json")


def _resolve(registry, use):
    import dataclasses

    from dsrecipes.core.schema import DatasetConfig
    from dsrecipes.data.sources.registry import resolve_sources

    return resolve_sources(dataclasses.replace(DatasetConfig(), paths=[], registry=registry, use=use), [])


def test_two_llamafactory_entries_naming_one_file_are_refused_naming_both(tmp_path):
    """Was: `dataset: a,b` with both entries on rows.json read the file once, as entry 'a' (b's columns and
    num_samples dropped, with a note) where LLaMA-Factory reads it twice. Now one message naming both and the file."""
    from dsrecipes.core.errors import ConfigError

    registry = _lf_registry(tmp_path, {"a": {"file_name": "rows.json"},
                                       "b": {"file_name": "./rows.json", "num_samples": 1},
                                       "c": {"file_name": "."}})  # fmt: skip
    rows = os.path.realpath(tmp_path / "data" / "rows.json")
    with pytest.raises(ConfigError) as refused:
        _resolve(registry, ["a", "b"])
    text = str(refused.value)
    assert text.startswith("dataset.use (LLaMA-Factory's `dataset:`): entries 'a' and 'b' both name "), text
    assert rows in text and registry in text and "Name it once" in text, text
    with pytest.raises(ConfigError, match=r"entries 'a' and 'c' both name .*rows.json"):  # c: the folder holding it
        _resolve(registry, ["a", "c"])
    with pytest.raises(ConfigError, match=r"entry 'a' is named twice .*rows.json"):
        _resolve(registry, ["a", "a"])
    assert [s.name for s in _resolve(registry, ["b"])] == ["b"]  # one entry: read as before


# ---------------------------------------------------------------------------------------------------------------
# 4. `dsrecipes export --out DIR` removes what an export to DIR killed mid-write left beside it


def test_an_export_removes_stale_staging_of_a_killed_export_and_nothing_else(tmp_path, monkeypatch, capsys):
    """Was: a SIGKILLed `dsrecipes export --out DIR` left `.DIR.tmp-HOST-PID-8hex` (a model-sized hidden copy) for
    good: only exports into a run directory removed stale staging. Now the export to DIR removes those of a dead
    process of this machine holding only export files; a live process's, another host's, a file of that name and
    a directory holding anything else stay."""
    import subprocess
    import sys

    import dsrecipes.rank.export as rank_export
    from dsrecipes.commands.export import main
    from dsrecipes.core.publish import _host

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "out"
    name = lambda pid, host=_host(), tail="0123abcd": tmp_path / f".out.tmp-{host}-{pid}-{tail}"
    stale, live, other_host = name(dead.pid), name(os.getpid()), name(dead.pid, "elsewhere")
    foreign_file, foreign_dir = name(dead.pid, tail="0123abce"), name(dead.pid, tail="0123abcf")
    for d in (stale, live, other_host, foreign_dir):
        d.mkdir()
        (d / "config.json").write_text("{}")
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 64)
    (foreign_dir / "notes.txt").write_text("mine")
    foreign_file.write_text("not a directory")
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    monkeypatch.setattr(rank_export, "export_checkpoint", lambda run_dir, tag_dir, out_dir, **kw: out_dir)
    assert main([str(run), "--tag", "step_2", "--out", str(out)]) == 0
    assert not stale.exists() and f"removed {stale}: what an earlier export to {out}" in capsys.readouterr().err
    assert all(p.exists() for p in (live, other_host, foreign_file, foreign_dir, foreign_dir / "notes.txt"))
