"""The launch supervision's open review findings, mended (run/launch/process.py, tree.py, commands/outcome.py).

- A launcher (torchrun's agent, DeepSpeed's per-node launch.py) SIGKILLed as its ranks ended with it (torchrun's
  rank, just started, ended within 0.1 s of its agent's kill): no rank was left to stop, and the run was reported as
  'a rank was killed by SIGKILL (the kernel's OOM killer ...)'. The run names the launcher's death.
- A sweep's launcher=local job runs the rank itself as the child: its SIGKILL is the rank's (the OOM killer's line),
  not a launcher's, also while its DataLoader workers (its process group) outlive it a moment.
- core/heartbeat.py looks for torchrun's agent (the rank's parent) in one place, `_agent_lost`, at every beat and when
  the store stops answering: gone, the rank stops as on SIGTERM once (was: a second SIGTERM when the store went after
  the beat had seen the agent gone), not while it is already ending; there, no peer is reported lost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import dsrecipes.core.heartbeat as heartbeat
import dsrecipes.run.launch.process as process
from dsrecipes.commands import outcome
from dsrecipes.core import stopping
from dsrecipes.run.launch.plan import Command

pytestmark = pytest.mark.usefixtures("fresh_stopping")  # (tests/conftest.py)


# A launcher whose rank (a session of its own, as torchrun's) ends at once, and which is SIGKILLed as it ends.
_KILLED_AS_ITS_RANK_ENDS = r"""
import os, signal, subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
rank.wait()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _concluded(run_dir: Path, code: int, capsys) -> tuple:
    capsys.readouterr()
    ended = outcome.conclude(run_dir, code, False, ["debug=fast"])
    return ended, capsys.readouterr().err, json.loads((run_dir / "result.json").read_text())


def test_a_launcher_killed_as_its_ranks_ended_is_named_not_an_out_of_memory_rank(tmp_path, capsys):
    """Was: 'a rank was killed by SIGKILL (the kernel's OOM killer sends it when memory runs out ...)': outcome.py
    read the launcher's own -9 as a rank's, since no rank was left for process.py to stop. Still a failed run (exit
    1, nothing was stopped at a step boundary: no stopping.cause, which says the ranks were), naming the launcher."""
    cmd = Command([sys.executable, "-c", _KILLED_AS_ITS_RANK_ENDS])
    code = process.run_subprocess(cmd, tmp_path, grace_s=10)
    assert code == -signal.SIGKILL and stopping.cause() is None
    (exit_code, interrupted), err, result = _concluded(tmp_path, code, capsys)
    assert "OOM" not in err and "a rank was killed" not in err, err
    named = re.fullmatch(r"error: (the launcher \(pid \d+, python\) was killed by SIGKILL; its ranks ended with it)\n", err)
    assert named, err
    assert (exit_code, interrupted) == (1, False) and result["status"] == "failed", result
    assert result["error"] == named[1] and "rank_signal" not in result, result
    assert process.killed_alone(tmp_path) is None  # said once


# A sweep's launcher=local rank, run as the child: SIGKILLed (the OOM killer) while its DataLoader worker (its process
# group) lives on a moment.
_RANK_KILLED = r"""
import os, signal, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sweeps_local_rank_killed_by_sigkill_is_the_ranks_kill_not_a_launchers(tmp_path, capsys):
    cmd = Command([sys.executable, "-c", _RANK_KILLED], {"RANK": "0"}, in_process=True)
    code = process.run_subprocess(cmd, tmp_path, grace_s=10, announce=False)
    assert code == -signal.SIGKILL
    (exit_code, interrupted), err, result = _concluded(tmp_path, code, capsys)
    assert "launcher" not in err and "a rank was killed by SIGKILL (the kernel's OOM killer" in err, err
    assert (exit_code, interrupted) == (1, False) and result["status"] == "failed", result


def _beat(tmp_path: Path, monkeypatch, agent) -> tuple:
    """A rank's heartbeat (not started) whose agent is `agent`: (it, the signals it sent itself, the peers it failed)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    beat = heartbeat.Heartbeat(tmp_path, 1, 2, 10.0)
    assert beat.agent == os.getppid()  # torchrun's agent: this rank's parent
    beat.agent = agent
    sent: list = []
    failed: list = []
    monkeypatch.setattr(heartbeat.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    monkeypatch.setattr(beat, "_fail", lambda ranks, reason: failed.append(reason))
    monkeypatch.setattr(heartbeat, "AGENT_GONE_S", 0.2)
    return beat, sent, failed


def test_the_agent_gone_stops_the_rank_once_by_the_beat_or_by_the_store(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    beat, sent, failed = _beat(tmp_path, monkeypatch, gone.pid)
    assert beat._agent_lost() and beat._agent_lost()  # each beat looks; the rank is stopped once
    assert sent == [(os.getpid(), signal.SIGTERM)] and not beat._stop.is_set()  # beating on: the store answers
    beat._store_lost("the job's store stopped answering")  # then the store went too: no peer lost, no second stop
    assert sent == [(os.getpid(), signal.SIGTERM)] and failed == [] and beat._stop.is_set()


def test_the_store_gone_with_the_agent_stops_the_rank_and_ends_its_beating(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    beat, sent, failed = _beat(tmp_path, monkeypatch, gone.pid)
    beat._store_lost("the job's store stopped answering")
    assert sent == [(os.getpid(), signal.SIGTERM)] and failed == [] and beat._stop.is_set()


def test_an_agent_that_lives_or_none_makes_a_store_gone_a_lost_peer(tmp_path, monkeypatch):
    for agent in (os.getppid(), None):
        beat, sent, failed = _beat(tmp_path, monkeypatch, agent)
        assert not beat._agent_lost()
        beat._store_lost("the job's store stopped answering")
        assert sent == [] and failed == ["the job's store stopped answering"]


def test_a_rank_already_ending_is_not_stopped_again_for_its_agent(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    beat, sent, failed = _beat(tmp_path, monkeypatch, gone.pid)
    beat._failing.acquire()  # `_fail` is reporting a lost peer in the other thread: the process ends with its code
    assert beat._agent_lost() and sent == []


def test_the_mark_is_looked_for_only_in_processes_younger_than_the_launcher(tmp_path, monkeypatch):
    """Tree.end read every process's environment for the launcher's mark at each run's end (1000 processes: 40-70 ms
    here); only the launcher's descendants carry it, all younger than it: the others' are not read now (~1 ms, ~20 ms
    the first time). A rank it started in a session of its own and never waited for is still found and ended."""
    read: list = []
    real = psutil.Process.environ
    monkeypatch.setattr(psutil.Process, "environ", lambda p: read.append(p.pid) or real(p))
    pid = tmp_path / "rank.pid"
    left = Command([sys.executable, "-c", "import subprocess, sys; open(sys.argv[1], 'w').write(str(subprocess.Popen("
                                          "[sys.executable, '-c', 'import time; time.sleep(30)'], "
                                          "start_new_session=True).pid))", str(pid)])  # fmt: skip
    assert process.run_subprocess(left, tmp_path, grace_s=10) == 0
    rank = int(pid.read_text())
    assert os.getpid() not in read and 1 not in read, read  # older than the launcher: not read (was: read)
    assert rank in read and (not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE)
