"""A launcher that starts its ranks in sessions of their own (torchrun does: torch's SubprocessHandler passes
start_new_session=True), supervised as a run's launcher is (run/launch/process.run_subprocess). Its ranks are out of
its process group, so everything built on that group missed them: a launcher SIGKILLed mid-run left its ranks
running, orphaned, holding the console's pipes (the run was reported 20 s later, by the relays' timeouts, as "a rank
was killed by SIGKILL (the kernel's OOM killer ...)"), and a run that ended left them behind. run/launch/tree.py
follows what the launcher started as last seen: those ranks are stopped at a step boundary like any, waited for,
named, and ended."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

import dsrecipes.run.launch.process as process
from dsrecipes.run.launch.plan import Command
from dsrecipes.run.launch.tree import Tree

# A launcher whose rank (argv[1]: where it "saves") leads a session of its own, as torchrun's ranks do. The rank
# saves and exits 143 on SIGTERM, after `argv[2]` seconds (a step boundary that takes a while), or never ("deaf").
_LAUNCHER = r"""
import os, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
def stop(*_):
    if sys.argv[2] == "deaf":
        return
    time.sleep(float(sys.argv[2]))
    open(sys.argv[1], "w").write("saved")
    os._exit(143)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".ready", "w").close()
for _ in range(1200):  # 60 s at most: a failed test leaves nothing running for long
    time.sleep(0.05)
''', sys.argv[1], sys.argv[2]], start_new_session=True)
open(sys.argv[1] + ".rank", "w").write(str(rank.pid))
time.sleep(600)
"""


def _ready(saved: Path) -> int:
    deadline = time.monotonic() + 20
    while not (saved.parent / (saved.name + ".ready")).exists() or not (saved.parent / (saved.name + ".rank")).exists():
        assert time.monotonic() < deadline, "the fake rank did not start"
        time.sleep(0.02)
    return int((saved.parent / (saved.name + ".rank")).read_text())


def _supervised(tmp_path: Path, delay: str, grace_s: float, kill_launcher: bool) -> tuple:
    """run_subprocess on _LAUNCHER in a thread; once the rank is ready, the launcher is SIGKILLed (or the launching
    process gets a SIGTERM-like stop): (exit code, the rank's pid, seconds from the kill to the end)."""
    saved = tmp_path / "saved"
    codes: list = []
    cmd = Command([sys.executable, "-c", _LAUNCHER, str(saved), delay])
    seen: dict = {}
    real_start = process._start

    def start(c, log):
        proc, relays = real_start(c, log)
        seen["proc"] = proc
        return proc, relays

    process._start = start
    try:
        runner = threading.Thread(target=lambda: codes.append(process.run_subprocess(cmd, tmp_path, grace_s)))
        runner.start()
        rank = _ready(saved)
        launcher = seen["proc"]
        assert psutil.Process(rank).ppid() == launcher.pid and psutil.Process(rank).pid == rank
        time.sleep(1.2)  # supervise looks at the launcher's tree every 0.5 s: a rank younger than that is not seen
        killed = time.monotonic()
        if kill_launcher:
            launcher.send_signal(signal.SIGKILL)
        runner.join(60)
        took = time.monotonic() - killed
    finally:
        process._start = real_start
    assert not runner.is_alive() and codes, "run_subprocess did not end"
    return codes[0], rank, took


def test_ranks_of_a_killed_launcher_outside_its_group_save_and_the_run_names_the_launcher(tmp_path, capsys):
    code, rank, took = _supervised(tmp_path, "0.5", grace_s=10, kill_launcher=True)
    err = capsys.readouterr().err
    assert code == -signal.SIGKILL, err
    assert "was killed by SIGKILL while its ranks ran; stopping them at the next step boundary" in err, err
    assert (tmp_path / "saved").read_text() == "saved", "the orphaned rank was not stopped with a checkpoint"
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
    assert took < 5, took


def test_an_orphaned_rank_that_does_not_stop_is_named_and_killed_at_the_grace(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(process, "STOP_NOTE_S", 0.5)
    code, rank, took = _supervised(tmp_path, "deaf", grace_s=1.5, kill_launcher=True)
    err = capsys.readouterr().err
    assert "did not stop within trainer.stop_grace_s=1.5 s of the stop signal; killed" in err, err
    assert f"pid {rank}" in err, err  # named by pid (a fake rank has no RANK in its environment)
    assert not (tmp_path / "saved").exists()
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
    assert took < 10, took


def test_a_process_seen_once_is_never_signalled_under_a_reused_pid(tmp_path):
    """psutil compares a pid's start time: a process that ended is not 'outside' any more, whoever has its pid."""
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])  # a launcher that has ended (its group is gone)
    launcher.wait()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    tree = Tree(launcher.pid)
    tree.seen[child.pid] = psutil.Process(child.pid)
    assert [p.pid for p in tree.outside()] == [child.pid] and tree.alive()
    child.kill()
    child.wait()
    assert tree.outside() == [] and not tree.alive()
