"""An interruption always keeps the last step (issue 22 item 2): signals that arrive together are one interruption;
only a second one after the first was acknowledged stops at once, and the message still names the latest checkpoint;
a resume command for a run without a checkpoint says it starts from step 1.

The handler tests send real signals to this process; test_ctrl_c_under_timeout_still_checkpoints interrupts a real
`python -m dsrecipes` run through `timeout`, which forwards a SIGINT it receives to its child and to its process
group, so the child gets it twice within milliseconds (what a terminal's Ctrl-C does under `timeout`, CI runners and
`srun`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dsrecipes.core.stopping as stopping
from tests.conftest import in_process_environ, subprocess_env


@pytest.fixture
def fresh_stop():
    stopping.reset()
    yield
    stopping.reset()


def test_two_sigints_within_milliseconds_are_one_interruption(fresh_stop, capsys):
    seen = []
    with stopping.handling(on_signal=seen.append, announce=True):
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the wrapper's copy: no KeyboardInterrupt, no second forward
        time.sleep(0.05)
    assert stopping.requested() == signal.SIGINT
    assert not stopping.forced()
    assert seen == [signal.SIGINT]
    assert capsys.readouterr().err.count("stopping at the next step boundary") == 1


def test_the_copy_that_arrives_while_the_first_is_being_announced_is_the_same_interruption(fresh_stop, monkeypatch):
    """On a loaded machine the wrapper's copy can run inside the first handler, while it prints the announcement
    (Python runs a pending handler at the next bytecode, also inside a handler): still one interruption, no
    KeyboardInterrupt (a CI run once stopped "at once by a second SIGINT" this way, without its checkpoint)."""
    import builtins

    real_print, copies = builtins.print, []

    def print_then_copy(*args, **kwargs):
        if not copies:
            copies.append(1)
            stopping._handler(signal.SIGINT, None)  # the copy, delivered mid-announcement
        real_print(*args, **kwargs)

    monkeypatch.setattr(builtins, "print", print_then_copy)
    try:
        with stopping.handling(announce=True):
            stopping._handler(signal.SIGINT, None)
    except KeyboardInterrupt:
        pytest.fail("the copy delivered during the announcement stopped the run at once")
    assert copies and stopping.requested() == signal.SIGINT and not stopping.forced()


def test_a_second_sigint_after_the_acknowledgement_stops_at_once(fresh_stop):
    with pytest.raises(KeyboardInterrupt):
        with stopping.handling(announce=True):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(stopping.SAME_INTERRUPTION_S + 0.2)
            assert not stopping.forced()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler raises at the next bytecode
    assert stopping.forced()


def test_a_sigterm_then_a_sigint_together_are_one_interruption(fresh_stop):
    with stopping.handling():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert stopping.requested() == signal.SIGTERM and not stopping.forced()


def _checkpoint(run: Path, step: int) -> Path:
    from dsrecipes.rank.checkpoint import COMPLETE

    tag = run / "checkpoints" / f"step_{step}"
    tag.mkdir(parents=True)
    (tag / COMPLETE).write_text("{}")
    return tag


def test_stopped_at_once_names_the_latest_checkpoint(tmp_path, fresh_stop, capsys, monkeypatch):
    from dsrecipes.commands.outcome import report_interrupted

    monkeypatch.setattr(stopping, "_forced", "stopped at once by a second SIGINT")
    _checkpoint(tmp_path, 2)
    latest = _checkpoint(tmp_path, 4)
    assert report_interrupted(tmp_path, signal.SIGINT, {}, ["debug=fast"]) == 130
    err = capsys.readouterr().err
    assert f"stopped at once by a second SIGINT (latest checkpoint: {latest})" in err
    assert json.loads((tmp_path / "result.json").read_text())["checkpoint"] == str(latest)


def test_a_run_without_a_checkpoint_says_its_resume_command_starts_from_step_1(tmp_path, fresh_stop, capsys):
    from dsrecipes.commands.outcome import report_interrupted

    report_interrupted(tmp_path, signal.SIGTERM, {}, ["debug=fast"])
    err = capsys.readouterr().err
    assert "interrupted by SIGTERM (no checkpoint yet: the command below starts from step 1)" in err
    assert "no checkpoint was written" not in err


# ---------------------------------------------------------------------------------------------------------------


def _args(ws: Path, run: Path):
    from tests.test_train_runs import SHORT

    return [*SHORT, f"data.cache_dir={ws / 'cache'}", f"trainer.output_dir={run}"]


@pytest.mark.slow
def test_ctrl_c_under_timeout_still_checkpoints(tmp_path):
    """`timeout` forwards one SIGINT twice (to the child, then to its group): the run still stops at the next step
    boundary with a verified checkpoint, says so once, and exits 130."""
    from dsrecipes.boundary.checkpoint_find import damage
    from tests.faults import fault_env
    from tests.test_signals import wait_for_step

    run = tmp_path / "under_timeout"
    argv = ["timeout", "900", sys.executable, "-m", "dsrecipes", *_args(tmp_path, run)]
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=subprocess_env(fault_env(tmp_path, pause_after_step=2)), stdout=log,
                                stderr=subprocess.STDOUT)
    wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGINT)  # to `timeout`, as the terminal's Ctrl-C
    code = proc.wait(timeout=600)
    text = (tmp_path / "run.log").read_text()
    assert code == 130, text[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "interrupted" and result["stopped_at_step"] == 3, text[-3000:]
    step_3 = run / "checkpoints" / "step_3"
    assert result["checkpoint"] == str(step_3) and damage(step_3) is None
    assert f"interrupted by SIGINT (latest checkpoint: {step_3})" in text
    assert text.count("stopping at the next step boundary") == 1 and "Traceback" not in text


@pytest.mark.slow
def test_a_second_attempt_without_a_checkpoint_says_it_starts_from_step_1(tmp_path, capsys, monkeypatch):
    """An earlier attempt ended in the run directory (here: a dry run) and left no checkpoint: the next start says
    it begins at step 1 instead of looking like a resume. Both run in this process (`dsrecipes.cli.main`)."""
    from dsrecipes.cli import main

    monkeypatch.chdir(tmp_path)
    args = [*_args(tmp_path, tmp_path / "again"), "trainer.max_steps=2"]
    with in_process_environ():
        code, first = main([*args, "launcher.dry_run=true"]), capsys.readouterr()
        assert code == 0, first.err[-3000:]
        assert "no checkpoint yet" not in first.out + first.err  # a first start is just a start
        code, done = main(args), capsys.readouterr()
        assert code == 0, done.err[-3000:]
        assert "no checkpoint yet: starting from step 1" in done.out + done.err


def test_sigterm_outside_the_launch_raises_like_ctrl_c_and_a_forked_worker_just_ends():
    """stopping.raising (around every subcommand, cli.run_guarded): SIGTERM is a KeyboardInterrupt that says which
    signal it was; a process forked inside the block (a preprocessing pool worker) ends as SIGTERM ends it."""
    with pytest.raises(stopping.Stopped) as stopped, stopping.raising():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert stopping.signal_of(stopped.value) == signal.SIGTERM and stopping.exit_code(signal.SIGTERM) == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored (pytest leaves the default)
    with stopping.raising():
        pid = os.fork()
        if pid == 0:  # the child: no traceback, no return into pytest
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(7)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def test_sigterm_while_preparing_data_reports_the_run_interrupted_with_the_resume_command(tmp_path, monkeypatch,
                                                                                        capsys):
    """Before the launch (data preparation runs in the launching process) a SIGTERM used to end the process with
    no result.json and no resume command: now it is exit 143, result.json `interrupted`, the command printed."""
    import dsrecipes.run.entry as entry
    from dsrecipes.cli import main

    real = entry.plan_run

    def preparing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, mid-preparation
        return real(*args, **kwargs)

    monkeypatch.setattr(entry, "plan_run", preparing)
    run = tmp_path / "run"
    with in_process_environ():
        code = main(["debug=fast", f"trainer.output_dir={run}", f"data.cache_dir={tmp_path / 'cache'}"])
    err = capsys.readouterr().err
    assert code == 143, err[-2000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "interrupted" and "interrupted by SIGTERM" in err and "Resume with:" in err
