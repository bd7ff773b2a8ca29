"""train.py / worker.py pieces that need no process group (the real runs are in test_train_runs.py)."""

from __future__ import annotations

import pytest

from dsrecipes.core.errors import UserError
from dsrecipes.core.rundir import read_ds_config
from dsrecipes.core.runplan import read_plan
from dsrecipes.rank.checkpoint import TrainState
from dsrecipes.rank.train import due, micro_batches


class FakeLoader:
    """Two epochs of three micro-batches; set_epoch keeps the position of the epoch it stands in."""

    def __init__(self, epoch=0, consumed=0):
        self.epoch, self.consumed, self.calls = epoch, consumed, []

    def set_epoch(self, epoch):
        self.calls.append(epoch)
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def __iter__(self):
        while self.consumed < 3:
            self.consumed += 1
            yield {"epoch": self.epoch, "n": self.consumed}


def test_micro_batches_cross_epochs_and_continue_a_resumed_epoch():
    state = TrainState()
    got = [(b["epoch"], b["n"]) for _, b in zip(range(5), micro_batches(FakeLoader(), state))]
    assert got == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2)] and state.epoch == 1

    resumed = TrainState(step=2, epoch=1)
    loader = FakeLoader(epoch=1, consumed=2)  # as load_state_dict left it
    got = [(b["epoch"], b["n"]) for _, b in zip(range(2), micro_batches(loader, resumed))]
    assert got == [(1, 3), (2, 1)] and loader.calls == [1, 2]


def test_due():
    assert due(10, 5) and not due(11, 5) and not due(10, 0)


def test_worker_tolerates_local_rank_and_reports_a_missing_run_dir(tmp_path, capsys, monkeypatch):
    from dsrecipes.rank.worker import main as worker_main

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert worker_main(["--run-dir", str(tmp_path), "--local_rank=1"]) == 2
    err = capsys.readouterr().err  # the first file a rank reads: its plan (the exports its launch accepted)
    assert "plan.json: missing" in err and "python -m dsrecipes" in err and "Traceback" not in err, err


def test_missing_ds_config_or_plan_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="ds_config.json"):
        read_ds_config(tmp_path)
    with pytest.raises(UserError, match="plan.json: missing"):
        read_plan(tmp_path)
    (tmp_path / "plan.json").write_text("{broken")
    with pytest.raises(UserError, match="plan.json: unreadable run plan"):
        read_plan(tmp_path)
