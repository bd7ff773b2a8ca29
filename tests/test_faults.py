"""tests/faults.py, the tests' fault injection from outside the package: a process started with fault_env's PYTHONPATH
patches the rank's functions once they load (and loads nothing itself); injected() patches this process and puts
everything back; a fault point that moved fails loudly instead of injecting nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env
from tests.faults import FAULTS, fault_env, injected

SCRIPT = """
import json, sys
import dsrecipes.cli  # the launching side: the shim makes it load nothing of the rank side
launching = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed") or m.startswith("dsrecipes.rank"))
from dsrecipes.rank import checkpoint, step_guard, train
print(json.dumps({"launching": launching, "add": step_guard.StepGuard.add.__module__,
                  "after_step": train.after_step.__module__, "stop_if_full": checkpoint._stop_if_full.__module__}))
"""


def _patched_in_a_new_process(env):
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env=subprocess_env(env))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_process_started_with_fault_env_patches_the_rank_functions_as_they_load(tmp_path):
    plain = _patched_in_a_new_process(None)
    assert (plain["add"], plain["after_step"], plain["stop_if_full"]) == (
        "dsrecipes.rank.step_guard", "dsrecipes.rank.train", "dsrecipes.rank.checkpoint")
    env = fault_env(tmp_path, nan_at_step=3, stall_after_step=2, kill_before_latest=4)
    assert fault_env(tmp_path, nan_at_step=3, stall_after_step=2, kill_before_latest=4) == env  # written once
    faulty = _patched_in_a_new_process(env)
    assert faulty["launching"] == plain["launching"] == []
    assert faulty["add"] == faulty["after_step"] == faulty["stop_if_full"] == "dsrecipes_test_faults"


def test_injected_patches_this_process_and_puts_everything_back():
    from dsrecipes.rank import checkpoint, step_guard, train

    before = (step_guard.StepGuard.add, train.after_step, checkpoint._stop_if_full)
    with injected(nan_at_step=1, pause_after_step=2, kill_before_latest=3):
        during = (step_guard.StepGuard.add, train.after_step, checkpoint._stop_if_full)
        assert all(d is not b for d, b in zip(during, before))
    assert (step_guard.StepGuard.add, train.after_step, checkpoint._stop_if_full) == before


def test_a_moved_fault_point_fails_loudly(monkeypatch):
    from dsrecipes.rank import train

    monkeypatch.setattr(train, "after_step", lambda session, extra: None)
    with pytest.raises(RuntimeError, match="no longer the fault point"):
        with injected(stall_after_step=2):
            pass
    with pytest.raises(ValueError, match="unknown faults"):
        fault_env(".", nan_at=3)
    assert set(FAULTS) == {"nan_at_step", "pause_after_step", "stall_after_step", "kill_before_latest",
                           "stall_before_rendezvous", "exit_before_rendezvous"}
