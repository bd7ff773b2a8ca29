"""A rank that never reaches the initial rendezvous ends the run within launcher.rendezvous_timeout_s (issue 43 item 5).

Before: torch's env:// rendezvous waited for the process-group timeout (30 minutes) for a rank that died or hung
before joining. Now every rank meets the others in the job's store first (core/rendezvous.py): a line while it waits
(whom, how long, the bound), then one message naming the ranks that never arrived, exit 2, nothing left.

End to end: `python -m dsrecipes` with 2 ranks on gloo (launcher=deepspeed, one node), rank 1 hung before it joins
(tests/faults.py: stall_before_rendezvous). The variant where rank 1 exits before the rendezvous (the launcher stops
rank 0 within seconds) runs with the fault matrix (DSRECIPES_FAULT_MATRIX=1).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List

import pytest

from dsrecipes.core.rendezvous import describe
from tests.fault_cases import end, read_json, start, wait_exit, wait_session_gone
from tests.faults import fault_env

TIMEOUT_S = 5  # the least launcher.rendezvous_timeout_s accepts
WAITING = "waiting at the rendezvous"


def _args(root: Path, *more: str) -> List[str]:
    run = root / "run"
    return ["debug=fast", "dataset.max_samples=16", "dataset.val_size=0", "trainer.eval_at_start=false",
            "trainer.export=false", f"dataset.paths=[{root / 'train.jsonl'}]", f"data.cache_dir={root / 'cache'}",
            f"trainer.output_dir={run}", f"hydra.run.dir={run}", "launcher=deepspeed", "launcher.num_gpus=2",
            *more]


def _run(root: Path, bound_s: float, **fault: int):
    """(exit code, console, result.json, seconds from the first rank's waiting line (or the start) to the end of
    every process, processes left)."""
    from tests.fault_cases import SAMPLE

    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_bytes(SAMPLE.read_bytes())
    console = root / "console.log"
    proc = start(_args(root, f"launcher.rendezvous_timeout_s={TIMEOUT_S}"), root, console, None,
                 fault_env(root, **fault))
    try:
        started = time.monotonic()
        while proc.poll() is None and WAITING not in console.read_text() and time.monotonic() - started < 300:
            time.sleep(0.1)
        at = time.monotonic()
        code = wait_exit(proc, bound_s)
        left = wait_session_gone(proc.pid, at + bound_s)
        took = time.monotonic() - at
    finally:
        end(proc)
    return code, console.read_text(), read_json(root / "run" / "result.json"), took, left


@pytest.mark.slow
def test_a_rank_hung_before_the_rendezvous_ends_the_run_naming_it(tmp_path):
    code, console, result, took, left = _run(tmp_path / "stalled", 30, stall_before_rendezvous=1)
    assert WAITING in console and "rank 1 (node 0) not arrived yet" in console, console[-3000:]
    assert code == 2, (code, console[-3000:])
    assert not left and took < TIMEOUT_S + 12, (took, left)  # the rest of the bound, then the launcher's 5 s grace
    assert "Traceback" not in console and "frame #" not in console, console[-3000:]
    message = f"launcher.rendezvous_timeout_s={TIMEOUT_S}: rank 1 (node 0) never reached the rendezvous"
    assert message in console and message in str(result.get("error")), (console[-3000:], result)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DSRECIPES_FAULT_MATRIX"), reason="with the fault matrix: DSRECIPES_FAULT_MATRIX=1")
def test_a_rank_dead_before_the_rendezvous_stops_the_others_within_seconds(tmp_path):
    started = time.monotonic()
    code, console, result, took, left = _run(tmp_path / "dead", 20, exit_before_rendezvous=1)
    # rank 0 was stopped by the launcher (the dead rank's code), not by its own rendezvous bound
    assert code == 3 and "never reached the rendezvous" not in console, (code, console[-3000:])
    assert not left and "Traceback" not in console, (left, console[-3000:])
    assert result.get("status") == "failed" and time.monotonic() - started < 300


def test_missing_ranks_are_named_with_their_nodes():
    assert describe([1], 2) == "rank 1 (node 0)"
    assert describe([3, 2, 5], 2) == "ranks 2, 3 (node 1); rank 5 (node 2)"
    assert describe([0, 4], None) == "ranks 0, 4"


def test_the_bound_is_validated_with_its_key():
    from dsrecipes.config.launcher_rules import launcher_problems
    from dsrecipes.core.schema import TrainConfig

    cfg = TrainConfig()
    assert cfg.launcher.rendezvous_timeout_s == 300
    cfg.launcher.rendezvous_timeout_s = 2
    assert "launcher.rendezvous_timeout_s: must be >= 5 seconds, got 2" in launcher_problems(cfg)
