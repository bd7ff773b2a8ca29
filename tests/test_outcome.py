"""commands/outcome.py: how a failed launch is recorded - a rank killed by a signal is named, never the launcher's
wrapped-around exit status (DeepSpeed's launcher exits 247 for a rank killed by SIGKILL)."""

from __future__ import annotations

import json

import pytest

from dsrecipes.commands import outcome
from dsrecipes.core import stopping


@pytest.fixture
def no_stop(monkeypatch):
    monkeypatch.setattr(stopping, "requested", lambda: None)


pytestmark = pytest.mark.usefixtures("fresh_stopping")  # (tests/conftest.py: no stop cause left by an earlier test)


@pytest.mark.parametrize("code, signal_name", [(247, "SIGKILL"), (-9, "SIGKILL"), (245, "SIGSEGV"), (250, "SIGABRT")])
def test_a_rank_killed_by_a_signal_is_named_in_result_json(tmp_path, no_stop, capsys, code, signal_name):
    exit_code, interrupted = outcome.conclude(tmp_path, code, False, ["debug=fast"])
    result = json.loads((tmp_path / "result.json").read_text())
    assert (exit_code, interrupted) == (1, False)
    assert result["exit_code"] == 1 and result["status"] == "failed" and result["rank_signal"] == signal_name
    assert f"killed by {signal_name}" in result["error"] and str(code) not in result["error"]
    assert f"error: a rank was killed by {signal_name}" in capsys.readouterr().err


@pytest.mark.parametrize("code", [1, 2])
def test_an_ordinary_failure_keeps_its_code(tmp_path, no_stop, code):
    assert outcome.conclude(tmp_path, code, False, ["debug=fast"]) == (code, False)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["exit_code"] == code and "rank_signal" not in result


def test_a_killed_rank_its_peer_saw_go_is_one_line_naming_it(tmp_path, no_stop, capsys):
    """A rank SIGKILLed on one machine: its peer's heartbeat records it lost, DeepSpeed's launcher exits 247. Before,
    three lines said it: DeepSpeed's '[ERROR] ... exits with return code = -9', the launching process's 'node 0
    failed: rank 1 stopped responding ... The ranks on the other nodes were stopped' (there were none) and 'a rank
    was killed by SIGKILL'. Now one line names the rank, the signal and what to do."""
    import subprocess
    import sys

    from dsrecipes.core import heartbeat
    from dsrecipes.core.console import is_noise
    from dsrecipes.run.launch.process import supervise

    lost = {"lost": [{"rank": 1, "node": 0, "host": "vm", "addr": "127.0.0.1"}], "reason": "no heartbeat for 4 s"}
    heartbeat.write_failure(tmp_path, lost)
    proc = subprocess.Popen(["sh", "-c", "exit 247"], start_new_session=True)
    assert supervise(proc, tmp_path) == 247
    assert outcome.conclude(tmp_path, 247, False, ["debug=fast"]) == (1, False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 was killed by SIGKILL (the kernel's OOM killer"), lines
    assert "other nodes" not in lines[0] and "the other ranks were stopped" in lines[0]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"].startswith("rank 1 was killed by SIGKILL") and result["rank_signal"] == "SIGKILL"
    print("[2026-12-06 13:43:27,502] [ERROR] [launch.py:259:sigkill_handler] ['python', '-u', '-m', "
          "'dsrecipes.rank.worker'] exits with return code = -9", file=sys.stderr)
    assert is_noise(capsys.readouterr().err.strip())  # DeepSpeed's version goes to logs/launcher.log only


def test_a_lost_node_is_still_said_by_the_launching_process(tmp_path, no_stop, capsys):
    import subprocess

    from dsrecipes.core import heartbeat
    from dsrecipes.run.launch.process import supervise

    heartbeat.write_failure(tmp_path, {"lost": [{"rank": 2, "node": 1, "host": "n1"}], "reason": "no heartbeat for 10 s"})
    assert supervise(subprocess.Popen(["sh", "-c", "exit 1"], start_new_session=True), tmp_path) == 1
    assert "error: node 1 (n1) failed: rank 2 stopped responding" in capsys.readouterr().err


def test_a_failed_launch_nobody_explained_still_ends_with_an_error_line(tmp_path, no_stop, capsys):
    """Before, a launch that failed without a rank's report (a launcher that could not start its ranks, a rank that
    exited 3 without a word) wrote result.json and printed nothing: a failed run whose console had no error line."""
    assert outcome.conclude(tmp_path, 3, False, ["debug=fast"]) == (3, False)
    err = capsys.readouterr().err
    assert err.startswith("error: the ranks exited with code 3 without a report") and "logs" in err, err
    assert json.loads((tmp_path / "result.json").read_text())["error"] == "the ranks exited with code 3 without a report"
