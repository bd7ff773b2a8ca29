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
