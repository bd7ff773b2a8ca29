"""Failures said once, tried for real first (helper pipecrash): a pipeline stage that crashes (an exception that is
no refusal) is one message naming the stage, the cause and where its traceback was kept, never a traceback on the
console."""

from __future__ import annotations

import sys

import pytest


@pytest.mark.parametrize("where", ["run", "check_machine"])  # inside Hydra's job (run dir claimed), before the claim
def test_a_stage_that_crashes_is_one_message_with_its_traceback_in_the_log(tmp_path, monkeypatch, capsys, where):
    """Tried for real (`dsrecipes pipeline p.yaml --out out`, the launch of the first stage raising RuntimeError as a
    bug or torch would): Hydra's 'Error executing job with overrides: [...]' and the whole traceback on the console
    (commands/pipeline.train_stage printed it), then 'error: pipeline: stage 'sft' (1 of 2) failed (exit 1); its run
    directory: ...' without the cause. Now one line: the cause as 'RuntimeError: ... (at file:line)', where its
    traceback is (the stage's logs/main.log; the pipeline's logs/pipeline.log where the stage made no run directory)
    and the pipeline's resume command; exit 2."""
    import dsrecipes.commands.train as train
    from dsrecipes.cli import main

    def crash(*args):
        raise RuntimeError("the launch broke")

    monkeypatch.setattr(train, where, crash)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text("shared: {debug: fast}\nstages:\n  - name: sft\n  - name: b\n    model_from: sft\n")
    code = main(["pipeline", "p.yaml", "--out", "out"])
    out, err = capsys.readouterr()
    log = tmp_path / "out" / ("sft/logs/main.log" if where == "run" else "logs/pipeline.log")
    command = f"cd {tmp_path} && {sys.executable} -m dsrecipes pipeline p.yaml --out out"
    assert code == 2 and "Traceback" not in out + err and "Error executing job" not in err, (out, err)
    assert err.count("error:") == 1 and err.count("RuntimeError") == 1, err
    err = err.splitlines()[-1]
    assert err.startswith("error: pipeline: stage 'sft' (1 of 2) failed (exit 1): RuntimeError: the launch broke (at "
                          "tests/test_redteam_live4.py:"), err
    assert f"(full traceback: out/{log.relative_to(tmp_path / 'out')}); " in err, err
    assert err.rstrip().endswith(f"resume with: {command}"), err
    assert "RuntimeError: the launch broke" in log.read_text() and "Traceback" in log.read_text()
    assert (tmp_path / "out" / "sft").is_dir() == (where == "run") and not (tmp_path / "out" / "b").exists()
