"""A crash of the launching process (an exception that is no refusal: a bug in dsrecipes or in a library it calls) is
one `error:` line naming its type, message and file:line, exit 1; its traceback goes to the command's log (a run's
logs/main.log) or to a file of its own under the user's cache, and a run records it in result.json.

Was: `dsrecipes train` re-raised it from the launching process (commands/train._launch: 'a single run re-raises'),
so the console got Python's whole traceback, and the run directory no result.json; a sweep printed the traceback
(traceback.print_exc) between its jobs' lines; every other command ended the same way."""

from __future__ import annotations

import json

import pytest

from dsrecipes.cli import console_main
from dsrecipes.core.failure import TRACEBACK_ENV


def boom(*args, **kwargs):
    raise RuntimeError("the launch broke")


def crash_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_run_that_crashes_is_one_line_its_traceback_in_the_run_log_and_result(tmp_path, monkeypatch, capsys):
    import dsrecipes.commands.train as train

    monkeypatch.setattr(train, "run", boom)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    code = console_main(["debug=fast", f"trainer.output_dir={run}"])
    line = crash_line(capsys.readouterr().err)
    log = run / "logs" / "main.log"
    assert code == 1
    assert line.startswith("error: RuntimeError: the launch broke (at tests/test_crash_line.py:"), line
    assert line.endswith(f"its traceback is in {log} ({TRACEBACK_ENV}=1 prints it here)"), line
    assert "Traceback (most recent call last)" in log.read_text() and "the launch broke" in log.read_text()
    result = json.loads((run / "result.json").read_text())
    assert result["status"] != "ok" and "RuntimeError: the launch broke" in json.dumps(result), result


def test_a_command_without_a_run_keeps_its_traceback_under_the_cache(tmp_path, monkeypatch, capsys):
    import dsrecipes.commands.ls as ls
    from dsrecipes.core import console

    monkeypatch.setattr(ls, "main", boom)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(console._SINK, "path", None)  # a fresh process: no run's log (an earlier test set one)
    assert console_main(["ls"]) == 1
    line = crash_line(capsys.readouterr().err)
    (log,) = (tmp_path / "cache" / "dsrecipes" / "crashes").glob("*.log")
    assert line.startswith("error: RuntimeError: the launch broke (at ") and str(log) in line, line
    assert "Traceback (most recent call last)" in log.read_text()


def test_the_traceback_is_on_the_console_when_asked_for(monkeypatch):
    import dsrecipes.commands.ls as ls

    monkeypatch.setattr(ls, "main", boom)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(RuntimeError, match="the launch broke"):
        console_main(["ls"])


def test_a_user_error_is_still_exit_2(capsys):
    assert console_main(["ls", "--no-such-flag"]) == 2
    assert crash_line(capsys.readouterr().err).startswith("error: ")


def test_a_sweep_says_a_crashed_job_in_one_line_and_goes_on(tmp_path, monkeypatch, capsys):
    import dsrecipes.commands.train as train
    from tests.test_sweep import dsrecipes_in_process

    monkeypatch.setattr(train, "run", boom)
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    code = dsrecipes_in_process("-m", "debug=fast", "zero=stage1,stage2", f"hydra.sweep.dir={sweep}")
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: RuntimeError: the launch broke (at ")]
    assert len(lines) == 2, err  # each job, and the sweep went on to the second
    jobs = json.loads((sweep / "summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["failed", "failed"], jobs
    for job, line in zip(jobs, lines):
        log = f"{job['run_dir']}/logs/main.log"
        assert f"its traceback is in {log}" in line and "the launch broke" in open(log).read(), line
