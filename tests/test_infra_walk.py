"""What a user on a shared cluster does around a live run: export it while it writes, kill or stop one rank, fill
its disk, resume on another number of ranks. Each test here failed on the code before its fix."""

from __future__ import annotations

import json

import pytest

import dsrecipes.core.manifest as manifest
from dsrecipes.boundary.point_of_use import ChangedCheckpoint, CheckedCheckpoint, reading
from dsrecipes.boundary.trust import sign
from dsrecipes.core.locks import unread
from dsrecipes.rank.checkpoint import COMPLETE, prune_checkpoints


def _checkpoint(root, step):
    d = root / f"step_{step}"
    (d / "data_state").mkdir(parents=True)
    (d / "data_state" / "rank0.json").write_text(json.dumps({"step": step}))
    record = {"step": step, "world_size": 1, "files": manifest.describe(d, skip=[COMPLETE])}
    (d / COMPLETE).write_text(json.dumps(sign(record)))  # as this user's runs sign it
    return d


def test_retention_leaves_a_checkpoint_that_an_export_is_reading(tmp_path):
    """Was: `dsrecipes export RUN` beside a run saving every step failed 6 times in 6 with 'step_71/
    mp_rank_00_model_states.pt: cannot open it to load (No such file or directory)': the run's retention
    (trainer.keep_checkpoints=2) removed the checkpoint the export was reading."""
    root = tmp_path / "checkpoints"
    oldest = _checkpoint(root, 1)
    checked = CheckedCheckpoint.open(oldest)  # what export (and a resume) holds while it reads
    _checkpoint(root, 2)
    _checkpoint(root, 3)
    prune_checkpoints(root, keep=2)
    assert oldest.is_dir(), "retention removed a checkpoint that was being read"
    assert json.loads(checked.read_bytes(oldest / "data_state" / "rank0.json")) == {"step": 1}
    checked.close()
    assert prune_checkpoints(root, keep=2) == [oldest]  # the next pass removes it
    assert sorted(d.name for d in root.iterdir()) == ["step_2", "step_3"]


def test_a_checkpoint_removed_while_export_opens_it_is_named_as_such(tmp_path):
    """The export chose a checkpoint that the run's retention is removing (or removed) before the export held it:
    one message saying so, not a missing-file error from the middle of the load."""
    tag = _checkpoint(tmp_path / "run" / "checkpoints", 5)
    with unread(tag / COMPLETE) as free:  # a retention pass in progress
        assert free
        with pytest.raises(ChangedCheckpoint, match="removed while it was being opened.*keep_checkpoints"):
            with reading(tag):
                pass
        with pytest.raises(ChangedCheckpoint, match="removed while it was being opened"):
            CheckedCheckpoint.open(tag)
    with reading(tag):  # no retention pass: held
        with unread(tag / COMPLETE) as free:
            assert not free
