"""Signals stop everything and keep work (tracker issue 10): real `python -m dsrecipes` processes, real signals.

  local, SIGINT then SIGTERM  1 rank in the launching process: it stops at the next step boundary, checkpoints,
                              writes result.json `interrupted` with the resume command, exits 130 / 143 (one run:
                              Ctrl-C, the same command again, SIGTERM); the printed command resumes it and the
                              losses equal an uninterrupted run's (trained in this process) step for step
  deepspeed, SIGTERM          (in tests/test_train_runs.py, whose 2-rank ZeRO-2 run is the reference) 2 ranks
                              under the deepspeed launcher: the signal reaches every rank, both checkpoint the same
                              step, no process of the run is left; a SIGKILLed launching process leaves no rank
                              training; the printed command finishes the run with the reference's losses

A fault (tests/faults.py, pause_after_step) holds rank 0 after step N until the stop arrives, so the signal always
lands while the run is in flight at a known step: the stop happens at the boundary of step N + 1.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from tests.conftest import in_process_environ, subprocess_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("signals")


def run_args(ws: Path, run: Path, *overrides: str) -> List[str]:
    from tests.test_train_runs import SHORT

    return [*SHORT, f"data.cache_dir={ws / 'cache'}", f"trainer.output_dir={run}", *overrides]


def argv(ws: Path, run: Path, *overrides: str) -> List[str]:
    return [sys.executable, "-m", "dsrecipes", *run_args(ws, run, *overrides)]


def start(ws: Path, run: Path, *overrides: str, pause_after: int | None = None) -> subprocess.Popen:
    from tests.faults import fault_env

    env = subprocess_env(fault_env(ws, pause_after_step=pause_after) if pause_after else None)
    log = open(ws / f"{run.name}.log", "a")
    return subprocess.Popen(argv(ws, run, *overrides), cwd=ws, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, timeout: int = 600) -> int:
    return proc.wait(timeout=timeout)


def log_of(ws: Path, run: Path) -> str:
    return (ws / f"{run.name}.log").read_text()


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    from dsrecipes.core.rundir import read_metrics

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("step") == step and "loss" in r for r in read_metrics(run)):
            return
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before step {step}"
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached")


def processes_of(run: Path) -> List[str]:
    """Every process on this machine whose command line names the run directory."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if str(run) in cmdline:
            found.append(f"{p.info['pid']}: {cmdline[:200]}")
    return found


def losses(run: Path) -> Dict[int, float]:
    from dsrecipes.core.rundir import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


def assert_interrupted_at(ws: Path, run: Path, code: int, signum: int, step: int = 3) -> str:
    from dsrecipes.boundary.checkpoint_find import damage

    assert code == 128 + signum, log_of(ws, run)[-4000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "interrupted" and result["stopped_at_step"] == step
    assert result["checkpoint"] == str(run / "checkpoints" / f"step_{step}")
    assert damage(run / "checkpoints" / f"step_{step}") is None  # a complete, verified checkpoint
    assert result["resume_command"] in log_of(ws, run)  # printed as well
    assert sorted(losses(run)) == list(range(1, step + 1))
    return result["resume_command"]


def resume(ws: Path, run: Path, command: str, env: Optional[Dict[str, str]] = None, expect_ok: bool = True) -> None:
    """Run the printed resume command as a user would, in a shell (`env`: on top of the test environment)."""
    with open(ws / f"{run.name}.log", "a") as log:
        code = subprocess.run(command, shell=True, env=subprocess_env(env), stdout=log, stderr=subprocess.STDOUT,
                              timeout=600).returncode
    assert (code == 0) is expect_ok, log_of(ws, run)[-4000:]


def no_process_left(run: Path, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while processes_of(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_of(run), processes_of(run)


# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_reference(ws) -> Path:
    """The uninterrupted run, trained in this process (nothing is signalled: it needs no process of its own)."""
    from dsrecipes.cli import main

    reference = ws / "local_reference"
    with in_process_environ(), open(ws / f"{reference.name}.log", "a") as log:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            code = main(run_args(ws, reference))
    assert code == 0, log_of(ws, reference)[-3000:]
    return reference


def test_ctrl_c_then_sigterm_to_a_local_run_checkpoint_and_the_printed_command_resumes_exactly(ws, local_reference):
    """One local run stopped twice, each time while it idles after a step: Ctrl-C (SIGINT) after step 2 stops it at
    step 3 (exit 130); the same command again resumes there and SIGTERM after step 5 stops it at step 6 (exit 143);
    each time result.json says `interrupted` with the checkpoint and the printed command (the same both times), and
    that command finishes the run with the uninterrupted run's losses, step for step."""
    run = ws / "signalled"
    commands = []
    for signum, after in ((signal.SIGINT, 2), (signal.SIGTERM, 5)):
        seen = len(log_of(ws, run)) if commands else 0
        proc = start(ws, run, pause_after=after)
        wait_for_step(run, after, proc)
        proc.send_signal(signum)
        commands.append(assert_interrupted_at(ws, run, finish(proc), signum, step=after + 1))
        assert commands[-1] in log_of(ws, run)[seen:]  # this session printed it
        no_process_left(run)
    assert commands[0] == commands[1], commands
    resume(ws, run, commands[1])
    assert losses(run) == losses(local_reference)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_after_the_command_returned_keeps_its_exit_code(signum):
    """`dsrecipes export ... && next`: a Ctrl-C or SIGTERM while the process tears down after the command's work was
    done and reported (~1 s with torch and DeepSpeed loaded) killed it with 130/143, a failure to the script. Here the
    signal comes from an exit handler, after cli.entry's command returned 3: the exit code stays 3."""
    code = ("import atexit, os, signal, time\nimport dsrecipes.cli as cli\ncli.main = lambda argv=None: 3\n"
            f"atexit.register(lambda: (os.kill(os.getpid(), {int(signum)}), time.sleep(10)))\ncli.entry()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])


def test_both_entry_points_end_through_cli_entry():
    """The console script and `python -m dsrecipes` take the same road (cli.entry)."""
    root = Path(__file__).parents[1]
    assert 'dsrecipes = "dsrecipes.cli:entry"' in (root / "pyproject.toml").read_text(encoding="utf-8")
    assert "entry()" in (root / "dsrecipes" / "__main__.py").read_text(encoding="utf-8")
