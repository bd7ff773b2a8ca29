"""Leftovers (third batch): the sweep table's `(earlier)` from what the sweep skipped, absolute paths in the "train
further" command, LLaMA-Factory entries naming one file, stale export staging directories, `step_N.replaced`."""

from __future__ import annotations

import json
import os
import time

from tests.test_walk5 import _earlier_sweep

# ---------------------------------------------------------------------------------------------------------------
# 1. The sweep table's `(earlier)`: the jobs this run of the sweep skipped, never a file's time


def _job(sw, n):
    from omegaconf import OmegaConf

    return OmegaConf.create({"hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(sw)},
                                       "runtime": {"output_dir": str(sw / str(n))}}})  # fmt: skip


def test_the_sweep_table_marks_the_skipped_job_earlier_whatever_the_clocks_say(tmp_path, capsys):
    """Was: `(earlier)` meant 'result.json older than the start of this run of the sweep': a skipped job whose file
    time is ahead of the clock (another machine's, a restored copy) was listed as run now, a job run now whose file
    time lags was listed `(earlier)`. Now the jobs the command skipped (FINISHED_EARLIER, Hydra's job return)."""
    from hydra.core.utils import JobReturn, JobStatus

    from dsrecipes.observe import sweep

    sw = _earlier_sweep(tmp_path / "sw", [["zero=stage0"], ["zero=stage1"]])
    future, past = time.time() + 3600, time.time() - 7200
    os.utime(sw / "0" / "result.json", (future, future))  # skipped now, its file time ahead of the clock
    (sw / "1" / "result.json").write_text(json.dumps({"status": "ok", "error": None, "final_loss": 0.5}))  # run now
    os.utime(sw / "1" / "result.json", (past, past))  # ... its file time behind it
    callback = sweep.SweepSummary()
    callback.on_multirun_start(config=None)
    callback.on_job_end(_job(sw, 0), JobReturn(status=JobStatus.COMPLETED, _return_value=sweep.FINISHED_EARLIER))
    callback.on_job_end(_job(sw, 1), JobReturn(status=JobStatus.COMPLETED, _return_value=None))
    callback.on_multirun_end(_job(sw, 1))
    out = capsys.readouterr().out
    assert "| 0 | stage0 | ok (earlier) |" in out and "| 1 (best) | stage1 | ok |" in out, out
    jobs = json.loads((sw / "summary.json").read_text())["jobs"]
    assert [(j["job"], j["earlier"]) for j in jobs] == [("0", True), ("1", False)]


def test_a_sweep_job_returns_finished_earlier_only_when_the_command_skipped_it(monkeypatch):
    from dsrecipes.commands import train
    from dsrecipes.observe.sweep import FINISHED_EARLIER

    inv = train.Invocation([], sweep=True)
    monkeypatch.setattr(train, "run_job", lambda inv, job: None)  # ran (or failed): not skipped
    assert train.sweep_job(inv, None) is None
    monkeypatch.setattr(train, "run_job", lambda inv, job: inv.done_earlier.append("/runs/0"))
    assert train.sweep_job(inv, None) == FINISHED_EARLIER
