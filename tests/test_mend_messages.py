"""Messages that name what happened, mended.

- A launcher still there LAUNCHER_EXIT_S after its ranks ended (stopped: SIGSTOP, a freezer) is killed by
  run/launch/process.supervise, and its -9 was read by commands/outcome.py as a rank's signal: a run whose ranks left
  no report ended with 'a rank was killed by SIGKILL (the kernel's OOM killer ...)', and a rank's own failure line
  got '(a rank was killed by SIGKILL)' appended. The ranks' outcome decides the run; the launcher's hang is named.
- A remedy is built once, where its refusal is raised: a pipeline's stage says the pipeline's (run/pipeline.remedies
  sets it around the stage: core/rundir.FOREIGN_REMEDY, run/resume_contract.RESUME_REMEDY), and a bad row met
  without the pre-scan says so (data/stream/unscanned.py sets badrows.ADVICE around its encoder). Was: train's text
  rewritten after the fact (`.replace()` of RESTORE_TAIL and FOREIGN_TAIL in the stage's failure; the quarantine
  advice cut off the refusal by `partition`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import threading
from pathlib import Path

import psutil
import pytest

import dsrecipes.run.launch.process as process
from dsrecipes.commands import outcome
from dsrecipes.config.pipeline_file import load_pipeline
from dsrecipes.core.errors import DataError, UserError
from dsrecipes.core.rundir import ensure_owned_dir
from dsrecipes.data.sources.badrows import BadReason, BadRow, error_message
from dsrecipes.data.stream.unscanned import TRAINING, RowsMetUnscanned
from dsrecipes.run import resume_contract
from dsrecipes.run.launch.plan import Command
from dsrecipes.run.pipeline import StageFailed, run_pipeline

pytestmark = pytest.mark.usefixtures("fresh_stopping")  # (tests/conftest.py)


# A launcher whose rank (its child, never reaped) runs a moment (seen by supervision's 0.5 s poll), then its code;
# the launcher stops itself (SIGSTOP).
_STOPPED_AFTER_ITS_RANK = r"""
import os, signal, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)\n" + sys.argv[1], sys.argv[2]])
os.kill(os.getpid(), signal.SIGSTOP)
"""
_FAILS_WITHOUT_A_REPORT = "import sys; sys.exit(1)"
_FAILS_WITH_A_REPORT = ("import sys\nfrom dsrecipes.core.failure import record_rank_failure\n"
                        "record_rank_failure(sys.argv[1], 0, ValueError('bad batch'), None)\nsys.exit(1)")
_FINISHES = ("import sys\nfrom dsrecipes.core.rank_records import write_outcome\n"
             "write_outcome(sys.argv[1], {'status': 'ok'})")


def _hung_run(run_dir: Path, rank: str, monkeypatch, capsys) -> tuple:
    """The launcher's code, its pid and what supervision printed, for a launcher stopped after its rank ran `rank`."""
    monkeypatch.setattr(process, "LAUNCHER_EXIT_S", 1.0)
    run_dir.mkdir(exist_ok=True)
    capsys.readouterr()
    code = process.run_subprocess(Command([sys.executable, "-c", _STOPPED_AFTER_ITS_RANK, rank, str(run_dir)]),
                                  run_dir, grace_s=10)
    err = capsys.readouterr().err
    said = re.search(r"^warning: every rank has ended, but the launcher \(pid (\d+), state stopped\) has not exited "
                     r"1 s later; .*killed", err, re.M)
    assert said, err
    return code, int(said[1]), err


def _concluded(run_dir: Path, code: int, capsys) -> tuple:
    capsys.readouterr()
    ended = outcome.conclude(run_dir, code, False, ["debug=fast"])
    return ended, capsys.readouterr().err, json.loads((run_dir / "result.json").read_text())


def test_ranks_that_left_no_report_under_a_hung_launcher_name_the_hang_not_the_oom_killer(tmp_path, monkeypatch,
                                                                                         capsys):
    """Was: 'error: a rank was killed by SIGKILL (the kernel's OOM killer sends it when memory runs out ...)'."""
    code, pid, _ = _hung_run(tmp_path, _FAILS_WITHOUT_A_REPORT, monkeypatch, capsys)
    assert code == -signal.SIGKILL
    (exit_code, interrupted), err, result = _concluded(tmp_path, code, capsys)
    assert "OOM" not in err and "a rank was killed" not in err, err
    cause = (f"the launcher (pid {pid}, {Path(sys.executable).name}) did not exit 1 s after its ranks ended and was "
             "killed by dsrecipes; the ranks left no report of how they ended")
    assert err == f"error: {cause}; what they printed is in {tmp_path / 'logs'}/\n", err
    assert (exit_code, interrupted) == (1, False) and result["status"] == "failed", result
    assert result["error"] == cause and "rank_signal" not in result, result
    assert process.launcher_hung(tmp_path) is None  # said once


def test_a_ranks_own_failure_line_is_unchanged_by_its_launchers_hang(tmp_path, monkeypatch, capsys):
    """Was: result.json's error 'rank 0 failed: ValueError: bad batch (a rank was killed by SIGKILL)'. Now the same
    line and exit code as under a launcher that exited with its rank's code."""
    hung, plain = tmp_path / "hung", tmp_path / "plain"
    code, _, _ = _hung_run(hung, _FAILS_WITH_A_REPORT, monkeypatch, capsys)
    shutil.copytree(hung, plain)
    (exit_code, interrupted), err, result = _concluded(hung, code, capsys)
    (plain_code, _), plain_err, plain_result = _concluded(plain, 1, capsys)
    assert "SIGKILL" not in err and "SIGKILL" not in result["error"], (err, result)
    assert result["error"] == plain_result["error"] == "rank 0 failed: ValueError: bad batch", result
    assert err == plain_err.replace(str(plain), str(hung)) and "error: rank 0 failed: ValueError: bad batch" in err
    assert (exit_code, interrupted) == (plain_code, False) == (1, False) and result["status"] == "failed"


def test_a_finished_run_whose_launcher_hung_at_exit_is_a_success_with_the_hang_named(tmp_path, monkeypatch, capsys):
    code, pid, said = _hung_run(tmp_path, _FINISHES, monkeypatch, capsys)
    (exit_code, interrupted), err, result = _concluded(tmp_path, code, capsys)
    assert (exit_code, interrupted) == (0, False) and result["status"] == "ok" and result["error"] is None, result
    assert "error" not in err, err
    assert "the ranks' own outcome decides" in said, said


def test_a_launcher_stopped_after_a_rank_that_ended_before_the_first_poll_is_ended_too(tmp_path, monkeypatch,
                                                                                        capsys):
    """Was: a rank never seen alive (it ended within the first 0.5 s poll) left its stopped launcher waited for
    forever: supervision counted live children only. Its zombie (the launcher never reaped it) counts."""
    monkeypatch.setattr(process, "LAUNCHER_EXIT_S", 1.0)
    launcher = ("import os, signal, subprocess, time\n"
                "rank = subprocess.Popen(['true'])\n"  # ends at once, never reaped (an unreferenced Popen's
                # __del__ polls, and reaped it when `true` had already ended: seen under load, no child ever seen)
                "time.sleep(0.2)\n"
                "os.kill(os.getpid(), signal.SIGSTOP)\n")
    codes: list = []
    runner = threading.Thread(target=lambda: codes.append(
        process.run_subprocess(Command([sys.executable, "-c", launcher]), tmp_path, grace_s=10)), daemon=True)
    runner.start()
    runner.join(timeout=20)
    for p in psutil.process_iter():  # (the old code: the stopped launcher is still there)
        with contextlib.suppress(psutil.Error):
            if p.ppid() == os.getpid() and "SIGSTOP" in " ".join(p.cmdline()):
                p.kill()
    assert codes == [-signal.SIGKILL], "the launching process is still waiting for the stopped launcher"
    assert process.launcher_hung(tmp_path) is not None
    assert "has not exited 1 s later" in capsys.readouterr().err


def _refused(*raising) -> list:
    """What each of `raising` (callables) is refused with, as a stage's train hands it on (commands/pipeline.py)."""
    said = []
    for refusal in raising:
        with pytest.raises(UserError) as exc:
            refusal()
        said.append(exc.value.problems[0])
    return said


def _settings(tmp_path: Path):
    return lambda: resume_contract.check({"trainer": {"seed": 1}}, {"trainer": {"seed": 2}}, "a", "a",
                                         "out/a/checkpoints/step_2")


def _foreign(tmp_path: Path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(exist_ok=True)
    (theirs / "notes.txt").write_text("mine")
    return lambda: ensure_owned_dir(theirs, "trainer.output_dir")


def test_a_stages_refusals_are_built_with_the_pipelines_remedy_and_trains_keep_theirs(tmp_path):
    """The settings and foreign-directory refusals raised inside a stage (run_pipeline's train) name the pipeline's
    remedy (was: train's text, rewritten by run_stage); outside a pipeline, train's, as before."""
    path = tmp_path / "p.yaml"
    path.write_text("stages:\n  - name: a\n")
    settings, foreign = _refused(_settings(tmp_path), _foreign(tmp_path))
    assert settings.endswith(f"trainer.seed: 1 -> 2\n{resume_contract.RESTORE_TAIL} (nothing was changed)"), settings
    assert foreign.endswith("Choose another directory; nothing was changed"), foreign
    for make, expected in ((_settings, "trainer.seed: 1 -> 2\n(nothing was changed); restore the stage's settings "
                                       f"in {path}, or start over with a new --out (a stage's trainer.output_dir is "
                                       "the pipeline's); it wrote nothing"),
                           (_foreign, "(notes.txt) and is not a dsrecipes run directory (no dsrecipes_run.json); "
                                      "dsrecipes writes only into a new or empty directory or one of its own runs. "
                                      "Move those files out of it, or start over with a new --out; nothing was "
                                      "changed; it wrote nothing")):
        refusal, raised = make(tmp_path), []

        def train(argv):
            try:
                refusal()
            except UserError as exc:
                raised.extend(exc.problems)
                raise StageFailed(exc.exit_code, exc.problems) from None

        out = tmp_path / f"out-{make.__name__}"
        with pytest.raises(UserError) as err:
            run_pipeline(load_pipeline(path), out, train, "dsrecipes pipeline p.yaml --out out")
        said = err.value.problems[0]
        assert expected in said and "another trainer.output_dir" not in said and "Choose another" not in said, said
        assert expected.partition("; it wrote nothing")[0] in raised[0], raised  # as raised: built there, once
    assert _refused(_settings(tmp_path), _foreign(tmp_path)) == [settings, foreign]  # (the stage's are reset)


def _met(bad: BadRow) -> str:
    """The refusal of `bad` by an encoder read without the pre-scan (rank 1, its training rows)."""

    raised = []

    def encoder(items):
        raised.append(DataError(error_message("p.jsonl:3", bad)))
        raise raised[0]

    with pytest.raises(DataError) as exc:
        RowsMetUnscanned(encoder, 1, TRAINING)([])
    assert exc.value is raised[0]  # the encoder's own refusal, not rewritten on its way out
    return exc.value.problems[0]


def test_a_bad_row_met_without_the_prescan_is_refused_with_its_advice_built_once():
    """Was: the encoder's refusal with the scan's quarantine advice, cut off by `partition` and said again."""
    met = ("the first bad row rank 1 met in its training rows, read in the epoch's shuffled order: with "
           "data.prescan=false rows are checked only as training reads them, so an earlier line of the stream may be "
           "bad too (data.prescan=true checks every row before training and names the first)")
    own = _met(BadRow(BadReason.invalid_json, "x"))
    assert own == (f"p.jsonl:3: invalid_json (x); {met}; fix or remove the row, or set dataset.bad_rows=skip to skip "
                   "bad rows as training meets them (without the pre-scan: no <run>/quarantine.jsonl, no "
                   "dataset.max_bad_fraction check)"), own
    other = _met(BadRow(BadReason.invalid_json, "x", advice="objective=dpo reads pairs"))
    assert other == f"p.jsonl:3: invalid_json (x); objective=dpo reads pairs; {met}", other
    scanned = error_message("p.jsonl:3", BadRow(BadReason.invalid_json, "x"))  # (outside the encoder: the scan's)
    assert scanned == "p.jsonl:3: invalid_json (x); set dataset.bad_rows=skip to quarantine bad rows", scanned
