"""Findings of a user walkthrough (walk4), each reproduced with the commands a user types.

1. `dsrecipes audit --ledger RUN` on a run stopped (SIGTERM, Ctrl-C) before step 1 with trainer.record_samples=true
   said the run 'holds no ledger/ directory; give the run directory of a run trained with
   trainer.record_samples=true': it was. It now says the run trained no step, so there is nothing to audit (exit 2,
   as for any directory with nothing to check; an empty ledger no longer passes as 'OK').
2. data=presharded, a part edited after `dsrecipes shard`: the run was refused ('the part was modified, re-shard')
   and then printed 'resume from CHECKPOINT with: <the same command>', which fails the same way. The refusal now
   names the `dsrecipes shard ... --force` command that writes the same parts again (recorded in the manifest), and
   no resume line follows it.
3. `dsrecipes train dataset=sample_prompts` (prompt rows for objective=grpo) under the default SFT objective stopped
   at preparation with 'no_assistant_turn (roles: ['user']); set dataset.bad_rows=skip to quarantine bad rows':
   skipping quarantines every row. The first message now says the rows are prompt rows and objective=grpo reads
   them (BadRow.advice, decided on the row's `reference`/`answer` key as e21e5bb does for pairs); under
   objective=dpo such a row is no longer called 'an SFT conversation'.
4. dataset.bad_rows=skip on a file whose every row is of the wrong kind (a pairs file under SFT, an SFT file under
   DPO) ended 'N of N rows are bad (...): no_assistant_turn=N; ...' with no word of the row kind. The refusal now
   ends with the advice bad_rows=error gives at the first row (BadRowReport counts each row's advice).
5. The 'train further' command repeated relative `dataset.paths=[data/mine.jsonl]` (and data.shard_dir, data.cache_dir,
   dataset.registry, trainer.resume_from) as typed, so it worked only from the directory the run started in; they are
   now written absolute, as model.path is since afaf8a9 (also in `dsrecipes shard`'s 'train with' and rebuild command).
"""

from __future__ import annotations

import json
import shlex
import signal

import pytest

from dsrecipes.cli import main as cli_main
from tests.conftest import in_process_environ


def _error_line(capsys, argv) -> str:
    """`dsrecipes ARGV` exits 2 with one line, `error: ...`, and no traceback; returns it."""
    with in_process_environ():
        code = cli_main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err


def _error_line_of_many(capsys, argv) -> str:
    """`dsrecipes ARGV` exits 2 with exactly one `error:` line (notes may come before it), no traceback."""
    with in_process_environ():
        code = cli_main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, (code, err)
    return errors[0]


@pytest.mark.slow
def test_audit_of_a_run_stopped_before_step_1_says_it_trained_no_step(tmp_path, capsys, monkeypatch):
    from dsrecipes.core import stopping
    from dsrecipes.run import launch

    def sigterm_before_step_1(*args, **kwargs):  # the signal as the rank starts: no step trained, no ledger line
        raise stopping.Stopped(signal.SIGTERM)

    monkeypatch.setattr(launch, "run_in_process", sigterm_before_step_1)
    monkeypatch.chdir(tmp_path)
    with in_process_environ():
        code = cli_main(["train", "debug=fast", "trainer.record_samples=true", "trainer.output_dir=runs/stop"])
    assert code == 143
    run = tmp_path / "runs" / "stop"
    assert json.loads((run / "result.json").read_text())["steps"] == 0
    capsys.readouterr()
    err = _error_line(capsys, ["audit", "--ledger", "runs/stop"])
    assert "trained no step" in err and "nothing to audit" in err and "interrupted by SIGTERM" in err, err
    assert "holds no ledger" not in err
    # a rank that opened its ledger and stopped at once: a session mark, no step (was: 'rank 0: 0 steps ... OK')
    (run / "ledger").mkdir()
    (run / "ledger" / "rank0.jsonl").write_text(json.dumps({"session": 1.0, "pid": 1}) + "\n")
    assert "trained no step" in _error_line(capsys, ["audit", "--ledger", "runs/stop"])



def test_audit_of_a_run_that_failed_before_step_1_is_one_line(tmp_path, capsys):
    (tmp_path / "result.json").write_text(json.dumps({"status": "failed", "steps": 0,
                                                      "error": "error: 2 problems:\n  - a\n  - b"}))
    err = _error_line(capsys, ["audit", "--ledger", str(tmp_path)])
    assert "trained no step" in err and "2 problems: - a - b, 0 steps" in err, err


@pytest.mark.slow
def test_an_edited_shard_part_is_refused_with_the_command_that_rebuilds_it(tmp_path, capsys, monkeypatch):
    from dsrecipes.data.shard.manifest import read_manifest, verify_part

    monkeypatch.chdir(tmp_path)
    shard = ["shard", "--parts", "1", "--out", "parts", "debug=fast", "dataset.max_samples=40", "dataset.val_size=0"]
    train = ["train", "debug=fast", "data=presharded", "data.shard_dir=parts", "trainer.output_dir=runs/ps",
             "trainer.max_steps=2", "trainer.save_every=2", "trainer.eval_every=0", "trainer.export=false"]
    with in_process_environ():
        assert cli_main(shard) == 0
        assert cli_main(train) == 0  # a checkpoint: the run a user resumes
    part = tmp_path / "parts" / "part_00.jsonl"
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join([lines[1], lines[0], *lines[2:]]))  # the user's edit: two rows swapped
    capsys.readouterr()
    with in_process_environ():
        assert cli_main([*train, "trainer.max_steps=4"]) == 2
    err = capsys.readouterr().err
    assert "part_00.jsonl: sha256 differs from manifest.json" in err and "Traceback" not in err, err
    assert "resume from" not in err, err  # was: the command that had just failed
    [refusal] = [line for line in err.splitlines() if line.startswith("error:")]
    rebuilds = [piece for piece in refusal.split("`") if piece.startswith("dsrecipes shard ")]
    assert len(rebuilds) == 1, err
    rebuild = rebuilds[0]
    assert rebuild.endswith(f"--out {tmp_path / 'parts'} --force") and "dataset.max_samples=40" in rebuild, rebuild
    monkeypatch.chdir(tmp_path / "runs")  # the printed command works from anywhere
    with in_process_environ():
        assert cli_main(shlex.split(rebuild)[1:]) == 0
    verify_part(read_manifest(str(tmp_path / "parts")), 0)  # the same parts again: the run resumes on them


@pytest.mark.parametrize("data", ["map", "iterable"])
def test_prompt_rows_under_sft_are_refused_naming_grpo(tmp_path, capsys, monkeypatch, data):
    monkeypatch.chdir(tmp_path)
    stream = ["trainer.max_steps=2", "scheduler.warmup_steps=0"] if data == "iterable" else []
    err = _error_line_of_many(capsys, ["train", "dataset=sample_prompts", "debug=fast", f"data={data}", *stream,
                                       f"data.cache_dir={tmp_path / 'cache'}"])  # no scan of another version
    assert "prompt_rows.jsonl:1: no_assistant_turn" in err and "objective=grpo reads prompt rows" in err, err
    assert "bad_rows=skip" not in err, err


def test_a_prompt_row_under_dpo_is_not_called_an_sft_conversation():
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.data.sources.badrows import BadRow
    from dsrecipes.data.sources.preference import _pair

    row = {"conversations": [{"from": "human", "value": "What is 2 + 2?"}], "answer": 4}
    with pytest.raises(BadRow) as bad:
        _pair(row, SourceConfig(name="p"), {})
    assert "prompt row" in bad.value.advice and "objective=grpo" in bad.value.advice
    assert "SFT conversation" not in bad.value.advice


SFT_ROW = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]}
PAIR_ROW = {"conversations": [{"from": "human", "value": "Hi"}], "chosen": {"from": "gpt", "value": "Hello!"},
            "rejected": {"from": "gpt", "value": "Go away."}}


@pytest.mark.parametrize("row, objective, advice", [
    (PAIR_ROW, "sft", "this looks like a preference pair"),
    (SFT_ROW, "dpo", "this looks like an SFT conversation"),
    ({"conversations": [{"from": "human", "value": "1 + 1?"}], "reference": "2"}, "sft", "objective=grpo reads"),
])
@pytest.mark.parametrize("data", ["map", "iterable"])
def test_all_rows_of_the_wrong_kind_under_bad_rows_skip_get_the_row_kind_advice(tmp_path, capsys, monkeypatch, row,
                                                                                objective, advice, data):
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for _ in range(12)))
    stream = ["trainer.max_steps=2", "scheduler.warmup_steps=0"] if data == "iterable" else []
    stream += ["objective.reference=live"] if data == "iterable" and objective == "dpo" else []
    err = _error_line_of_many(capsys, ["train", "debug=fast", f"objective={objective}", "dataset=sharegpt_files",
                                       f"dataset.paths=[{rows}]", "dataset.val_size=0", "dataset.bad_rows=skip",
                                       f"data={data}", *stream, f"data.cache_dir={tmp_path / 'cache'}"])
    assert "12 of 12 rows are bad" in err and advice in err, err


def test_the_train_further_command_names_local_data_paths_absolute(tmp_path, capsys, monkeypatch):
    from dsrecipes.observe.report import resume_command

    (tmp_path / "data").mkdir()
    rows = tmp_path / "data" / "mine.jsonl"
    rows.write_text("".join(json.dumps({**SFT_ROW, "id": str(i)}) + "\n" for i in range(24)))
    monkeypatch.chdir(tmp_path)
    typed = ["dataset=sharegpt_files", "dataset.paths=[data/mine.jsonl,'s3://bucket/x.jsonl']", "data.shard_dir=parts",
             "data.cache_dir=cache", "dataset.registry=null", "model.path=HuggingFaceTB/SmolLM2-135M"]
    command = shlex.split(resume_command(tmp_path / "runs" / "ft", typed, 8, 8))
    assert f"dataset.paths=[{rows},'s3://bucket/x.jsonl']" in command, command
    assert f"data.shard_dir={tmp_path / 'parts'}" in command and f"data.cache_dir={tmp_path / 'cache'}" in command
    assert "dataset.registry=null" in command and "model.path=HuggingFaceTB/SmolLM2-135M" in command, command


@pytest.mark.slow
def test_the_printed_train_further_command_resumes_from_another_directory(tmp_path, capsys, monkeypatch):
    """A real run, and its printed command typed from another directory: it resumes (was: 'matches no file')."""
    (tmp_path / "data").mkdir()
    rows = tmp_path / "data" / "mine.jsonl"
    rows.write_text("".join(json.dumps({**SFT_ROW, "id": str(i)}) + "\n" for i in range(24)))
    monkeypatch.chdir(tmp_path)
    run = ["train", "debug=fast", "dataset=sharegpt_files", "dataset.paths=[data/mine.jsonl]", "dataset.val_size=0",
           "trainer.max_steps=1", "trainer.eval_every=0", "trainer.export=false", "trainer.output_dir=runs/ft",
           f"data.cache_dir={tmp_path / 'cache'}"]
    with in_process_environ():
        assert cli_main(run) == 0
    further = [line for line in capsys.readouterr().out.splitlines() if "train further:" in line]
    assert len(further) == 1 and f"dataset.paths=[{rows}]" in further[0], further
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with in_process_environ():
        assert cli_main(shlex.split(further[0].split("train further:", 1)[1])[1:]) == 0
    assert json.loads((tmp_path / "runs" / "ft" / "result.json").read_text())["steps"] == 2
