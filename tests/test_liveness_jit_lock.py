"""A JIT op build's lock file left by a killed build (torch's FileBaton: the file exists, nobody builds): a rank
waiting for it says which file after jit_ops.BUILD_NOTE_S and ends after jit_ops.BUILD_WAIT_S with one message
naming it. Before, torch's FileBaton.wait looped while the file existed: for ever, in silence, on every later run."""

from __future__ import annotations

import threading

from dsrecipes.core import jit_ops
from dsrecipes.core.errors import UserError
from tests.fault_cases import outcome_within


def test_a_stale_build_lock_is_said_and_ends_the_wait(tmp_path, monkeypatch, capsys):
    from torch.utils import file_baton

    monkeypatch.setattr(file_baton.FileBaton, "wait", file_baton.FileBaton.wait)  # restored after the test
    monkeypatch.setattr(jit_ops, "BUILD_WAIT_S", 0.8, raising=False)  # (absent before: no bound)
    monkeypatch.setattr(jit_ops, "BUILD_NOTE_S", 0.2, raising=False)
    if hasattr(jit_ops, "_bound_build_waits"):
        jit_ops._bound_build_waits()
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")  # what a build killed mid-way leaves
    try:
        outcome, took = outcome_within(lambda: file_baton.FileBaton(str(lock)).wait(), 10)
    finally:
        lock.unlink()  # (ends the old loop too)
    assert took < 3, took
    assert isinstance(outcome, UserError) and str(outcome).startswith(f"{lock}: another process's build")
    said = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dsrecipes: waiting for another")]
    assert len(said) == 1 and "build of cpu_adam" in said[0] and str(lock) in said[0], said


def test_a_build_that_ends_releases_the_waiters(tmp_path, monkeypatch):
    from torch.utils import file_baton

    monkeypatch.setattr(file_baton.FileBaton, "wait", file_baton.FileBaton.wait)
    monkeypatch.setattr(jit_ops, "BUILD_WAIT_S", 10.0, raising=False)
    jit_ops._bound_build_waits()
    building = file_baton.FileBaton(str(tmp_path / "lock"))
    assert building.try_acquire()
    threading.Timer(0.3, building.release).start()
    file_baton.FileBaton(str(tmp_path / "lock")).wait()  # returns once the builder is done
    assert not (tmp_path / "lock").exists()
