"""The stall watchdog end to end (core/stall.py): `python -m dsrecipes` with 2 ranks on gloo (launcher=deepspeed, one
node), rank 0 frozen after step 1 (tests/faults.py: stall_after_step, a sleep in the main thread while its heartbeat
beats on) and rank 1 waiting in its next collective. Within launcher.stall_timeout_s plus the launcher's stop, the run
ends: exit 75, one message naming rank 0 and what it was doing (step 1, evaluation), result.json failed with it, no
process left. Before, three lines said it (each rank's, then the launching process's "The ranks on the other nodes
were stopped"), with a C++ stack from rank 1's heartbeat meeting the store of the rank that had gone. ~20 s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fault_cases import SAMPLE, end, read_json, start, wait_exit, wait_session_gone
from tests.faults import fault_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 3


def test_a_frozen_rank_ends_the_run_naming_it(tmp_path: Path):
    (tmp_path / "train.jsonl").write_bytes(SAMPLE.read_bytes())
    run, console = tmp_path / "run", tmp_path / "console.log"
    args = ["debug=fast", "dataset.max_samples=16", "dataset.val_size=0", "trainer.eval_at_start=false",
            "trainer.export=false", f"dataset.paths=[{tmp_path / 'train.jsonl'}]", f"data.cache_dir={tmp_path / 'c'}",
            f"trainer.output_dir={run}", f"hydra.run.dir={run}", "launcher=deepspeed", "launcher.num_gpus=2",
            "launcher.stall_warn_s=1", f"launcher.stall_timeout_s={TIMEOUT_S}"]  # fmt: skip
    proc = start(args, tmp_path, console, None, fault_env(tmp_path, stall_after_step=1))
    try:
        began = time.monotonic()
        while proc.poll() is None and "phase eval" not in console.read_text() and time.monotonic() - began < 240:
            time.sleep(0.1)
        frozen = time.monotonic()  # rank 0 named as waiting (1 s into the stall)
        code = wait_exit(proc, 60)
        left = wait_session_gone(proc.pid, time.monotonic() + 10)
        took = time.monotonic() - frozen
    finally:
        end(proc)
    out = console.read_text()
    print(f'start to frozen {frozen - began:.1f} s, then {took:.1f} s')
    assert code == 75, (code, out[-3000:])
    assert not left and took < TIMEOUT_S + 10, (took, left)  # the rest of the bound, the launcher stopping rank 1
    said = [line for line in out.splitlines() if "the run stalled" in line]
    assert len(said) == 1 and said[0].startswith("error: the run stalled: rank 0 (node 0, host "), said
    assert "at step 1, phase eval (evaluation)" in said[0] and "Every rank was stopped" in said[0], said
    assert "Traceback" not in out and "frame #" not in out, out[-3000:]
    result = read_json(run / "result.json")
    assert (result.get("status"), result.get("exit_code")) == ("failed", 75), result
    assert str(result.get("error")).startswith("the run stalled: rank 0 (node 0"), result
