"""A sweep survives a job whose rank stalls (launcher=local, the default on CPU).

The stall watchdog ends a stuck rank's process (core/heartbeat.py: os._exit(75)); with launcher=local the rank ran
inside the launching process, so that ended the whole sweep: the later jobs never ran and the summary never listed
them. A sweep's job now runs its local rank as a child process (run/launch/process.py `run_in_process`): the stall
ends that job only. Here job 0 (3 steps) stalls after step 1 (tests/faults.py: stall_after_step, a sleep in the
rank's main thread; not after the last step, so job 1's single step runs through) and job 1 trains."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dsrecipes.observe import sweep
from tests.fault_cases import SAMPLE, end, start, wait_exit, wait_session_gone
from tests.faults import fault_env

# Job 1's final checkpoint save falls under the same bound: 2 s ended it once at load ~6 on the 2-core machine
# ("stalled ... phase checkpoint (checkpoint save) for 2 s"); 10 s keeps the stall of job 0 short and job 1 safe.
TIMEOUT_S = 10


@pytest.mark.slow  # two real jobs, each rank a fresh interpreter (~25 s on the 2-core machine)
def test_a_stalled_job_ends_alone_and_the_sweep_goes_on(tmp_path: Path):
    (tmp_path / "train.jsonl").write_bytes(SAMPLE.read_bytes())
    sweep_dir, console = tmp_path / "sweep", tmp_path / "console.log"
    args = ["-m", "trainer.max_steps=3,1", "debug=fast", "dataset.max_samples=16", "dataset.val_size=0",
            "trainer.eval_at_start=false", "trainer.eval_every=0", "trainer.save_every=0", "trainer.export=false",
            "scheduler.warmup_steps=0", f"dataset.paths=[{tmp_path / 'train.jsonl'}]",
            f"data.cache_dir={tmp_path / 'c'}", f"hydra.sweep.dir={sweep_dir}", "launcher.stall_warn_s=1",
            f"launcher.stall_timeout_s={TIMEOUT_S}"]  # fmt: skip
    proc = start(args, tmp_path, console, None, fault_env(tmp_path, stall_after_step=1))
    try:
        began = time.monotonic()
        code = wait_exit(proc, 120)
        took = time.monotonic() - began
        left = wait_session_gone(proc.pid, time.monotonic() + 10)
    finally:
        end(proc)
    out = console.read_text()
    print(f"sweep took {took:.1f} s")
    assert code == 75, (code, out[-3000:])  # the first failed job's code: the sweep went on, and says one failed
    assert not left, left  # no rank, no DataLoader worker of either job
    results = [json.loads((sweep_dir / job / "result.json").read_text()) for job in ("0", "1")]
    assert (results[0]["status"], results[0]["exit_code"]) == ("failed", 75), results[0]
    assert str(results[0]["error"]).startswith("the run stalled: rank 0 (host "), results[0]
    assert results[1]["status"] == "ok" and results[1]["error"] is None, results[1]
    jobs = json.loads((sweep_dir / "summary.json").read_text())["jobs"]
    assert [(j["job"], j["status"]) for j in jobs] == [("0", "failed"), ("1", "ok")], jobs
    table = (sweep_dir / "summary.md").read_text()
    assert "| 0 | 3 | failed |" in table and "the run stalled: rank 0" in table and "| 1 | 1 | ok |" in table, table
    said = [line for line in out.splitlines() if "the run stalled" in line and line.startswith("error:")]
    assert len(said) == 1, out[-3000:]  # said once (by the rank, as in a single local run), not again by its parent
    assert "sweep summary" in out and "Traceback" not in out, out[-3000:]


def test_a_dsrecipes_sweeps_job_is_known_as_one():
    """config/hydra_app.multirun calls Hydra.multirun without Hydra's `hydra.mode=MULTIRUN` override, so its jobs have
    no mode: only their job number says so. Before, such a job was taken for a single run, so the summary was not
    written after each job (a killed sweep had no table) and launcher=local would not know to run its rank apart."""
    from omegaconf import OmegaConf

    def job(mode, num):
        return OmegaConf.create({"hydra": {"mode": mode, "job": {"num": num}}})

    assert sweep._is_multirun(job(None, 0)) and sweep._is_multirun(job("MULTIRUN", 1))
    assert not sweep._is_multirun(job("RUN", "???")) and not sweep._is_multirun(job(None, "???"))
    assert not sweep._is_multirun(OmegaConf.create({"trainer": {}})) and not sweep.in_sweep()  # no Hydra here
