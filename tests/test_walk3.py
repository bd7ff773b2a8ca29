"""Findings of a user walkthrough (walk3).

A file of the wrong row kind for the objective (an SFT conversation file given to objective=dpo or to `dsrecipes
score --pairs`, a pairs file given to SFT) was refused at its first row with "set dataset.bad_rows=skip to
quarantine bad rows": skipping would quarantine every row. The refusal now names what reads that kind of row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from dsrecipes.core.errors import UserError

SFT = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
PAIR = {"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "gpt", "value": "Hello!"},
        "rejected": {"from": "gpt", "value": "Go away."}}
STRATEGIES = ("map", "iterable", "presharded")  # prepare, the stream's scan, `dsrecipes shard`


def _write(path: Path, rows: List[Dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _prepare_error(tmp_path: Path, rows: List[Dict[str, Any]], *overrides: str, strategy: str = "map") -> str:
    """The refusal of the strategy's launching-side reader: map preparation, the stream's scan, `dsrecipes shard`."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare
    from dsrecipes.data.shard.build import shard
    from dsrecipes.data.stream.scan import scan_stream

    data = _write(tmp_path / "d.jsonl", rows)
    stream = ["data=iterable", "trainer.max_steps=2", "scheduler.warmup_steps=0"] if strategy == "iterable" else []
    cfg = compose_and_load([*overrides, *stream, "dataset=sharegpt_files", f"dataset.paths=[{data}]",
                            "dataset.val_size=0", "dataset.bad_rows=error", f"data.cache_dir={tmp_path}/c"])
    with pytest.raises(UserError) as err:
        if strategy == "map":
            prepare(cfg, load_tokenizer(cfg), tmp_path / "run")
        elif strategy == "iterable":
            scan_stream(cfg, tmp_path / "run")
        else:
            shard(cfg, 1, str(tmp_path / "parts"), force=True)
    return str(err.value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_sft_file_given_to_dpo_names_what_reads_pairs_not_bad_rows_skip(tmp_path, strategy):
    message = _prepare_error(tmp_path, [SFT, SFT], "objective=dpo", "objective.reference=live", strategy=strategy)
    assert ":1: missing_side" in message, message
    assert "bad_rows=skip" not in message and "objective=dpo" in message and "dataset=sample_pairs" in message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_pairs_file_given_to_sft_names_what_reads_pairs_not_bad_rows_skip(tmp_path, strategy):
    message = _prepare_error(tmp_path, [PAIR, PAIR], strategy=strategy)
    assert ":1: no_assistant_turn" in message, message
    assert "bad_rows=skip" not in message and "preference pair" in message and "objective=dpo" in message


def test_a_genuinely_bad_row_still_says_bad_rows_skip(tmp_path):
    """A conversation without an answer that is no pair, and a pair that lacks one side, are bad rows."""
    no_answer = {"conversations": [{"from": "human", "value": "Hi"}]}
    assert "set dataset.bad_rows=skip" in _prepare_error(tmp_path, [no_answer, SFT])
    one_side = {k: v for k, v in PAIR.items() if k != "rejected"}
    message = _prepare_error(tmp_path, [one_side, PAIR], "objective=dpo", "objective.reference=live")
    assert "missing_side" in message and "set dataset.bad_rows=skip" in message, message


def test_score_pairs_on_an_sft_file_names_what_reads_pairs(tmp_path):
    from dsrecipes.commands.score import read_pairs

    path = _write(tmp_path / "sft.jsonl", [SFT, SFT])
    with pytest.raises(UserError) as err:
        read_pairs(path)
    assert "bad_rows=skip" not in str(err.value) and "score --pairs" in str(err.value), str(err.value)


# A relative `model.path` was stored as typed in the run's config.yaml (and repeated in "train further"), so the run's
# commands and `dsrecipes export/chat RUN` worked only from the directory it was started in.


def test_a_relative_local_model_path_is_made_absolute_and_a_hub_id_is_not(tmp_path, monkeypatch):
    from dsrecipes.config.defaults import with_derived_defaults
    from dsrecipes.config.load import compose_and_load

    (tmp_path / "runs" / "sft" / "export").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = with_derived_defaults(compose_and_load(["model.path=runs/sft/export"], check_files=False))
    assert cfg.model.path == str(tmp_path / "runs" / "sft" / "export")
    hub = with_derived_defaults(compose_and_load(["model.path=HuggingFaceTB/SmolLM2-135M"], check_files=False))
    assert hub.model.path == "HuggingFaceTB/SmolLM2-135M"


def test_a_run_that_recorded_a_relative_model_path_resumes_from_the_same_directory(tmp_path, monkeypatch):
    """Runs started before the change recorded `runs/sft/export`; the same command now records it absolute."""
    from dsrecipes.run.resume_contract import compare

    (tmp_path / "runs" / "sft" / "export").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    now = str(tmp_path / "runs" / "sft" / "export")
    refused, _ = compare({"model": {"path": "runs/sft/export"}}, {"model": {"path": now}})
    assert refused == []
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # from another directory the relative path named another model directory
    refused, _ = compare({"model": {"path": "runs/sft/export"}}, {"model": {"path": now}})
    assert [r.split(":")[0] for r in refused] == ["model.path"]


def test_the_train_further_command_names_the_model_directory_absolute(tmp_path, monkeypatch):
    from dsrecipes.observe.report import resume_command

    (tmp_path / "runs" / "sft" / "export").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    command = resume_command(tmp_path / "runs" / "ft", ["debug=fast", "model.path=runs/sft/export"], 8, 8)
    assert f"model.path={tmp_path / 'runs' / 'sft' / 'export'}" in command, command
