"""Findings of a user walkthrough (walk4), each reproduced with the commands a user types.

1. `dsrecipes audit --ledger RUN` on a run stopped (SIGTERM, Ctrl-C) before step 1 with trainer.record_samples=true
   said the run 'holds no ledger/ directory; give the run directory of a run trained with
   trainer.record_samples=true': it was. It now says the run trained no step, so there is nothing to audit (exit 2,
   as for any directory with nothing to check; an empty ledger no longer passes as 'OK').
"""

from __future__ import annotations

import json
import signal

from dsrecipes.cli import main as cli_main
from tests.conftest import in_process_environ


def _error_line(capsys, argv) -> str:
    """`dsrecipes ARGV` exits 2 with one line, `error: ...`, and no traceback; returns it."""
    with in_process_environ():
        code = cli_main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    return err


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
