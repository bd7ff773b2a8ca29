"""`dsrecipes audit` (the plan check) and the sample ledger (`verify_ledgers`, `audit --ledger`)."""

from __future__ import annotations

import json

import pytest

from dsrecipes.cli import main as cli_main
from dsrecipes.data.plan.epoch import Layout
from dsrecipes.data.plan.ledger import LedgerWriter, read_ledger, verify_ledgers
from dsrecipes.data.strategies.audit import audit_map, audit_presharded, audit_stream


def audit(*args: str) -> int:
    return cli_main(["audit", *args])


def write_jsonl(path, n):
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"{path.stem}-{i}", "conversations": [
                {"from": "human", "value": "hi"}, {"from": "gpt", "value": f"x{i}"}]}) + "\n")
    return str(path)


@pytest.mark.parametrize("world", [1, 2, 5, 8])
@pytest.mark.parametrize("workers", [0, 1, 4])
def test_audit_functions_pass(world, workers):
    lay = Layout(world, 2, 2, workers)
    assert audit_map(301, lay, 1, True, 2).ok
    rep = audit_stream([1, 0, 250, 3, 60], lay, 1, True, 16, 2)  # uneven, empty, fewer files than readers
    assert rep.ok, rep.render()
    assert audit_stream([100, 214], lay, 1, False, 16, 1, num_samples=314).ok
    counts = [41 + (r % 2) for r in range(world)]
    assert audit_presharded(counts, lay, 1, True, 8, 2).ok


def test_audit_reports_violations():
    lay = Layout(4, 2, 1, 2)
    rep = audit_presharded([40, 16, 16, 16], lay, 0, True, 8, 1)  # unbalanced parts: too much left unread
    assert not rep.ok and "not read" in rep.violations[0] and "unbalanced" in rep.render()
    rep = audit_presharded([16, 16, 16], lay, 0, True, 8, 1)
    assert not rep.ok and "re-shard with --parts 4" in rep.violations[0]
    rep = audit_stream([10, 10], lay, 0, True, 8, 1, num_samples=30)
    assert not rep.ok and "num_samples=30" in rep.violations[0]
    rep = audit_map(7, lay, 0, True, 1)  # less than one global batch
    assert not rep.ok and "no step at all" in rep.render()


def test_audit_cli_map_num_rows(capsys):
    assert audit("--world-size", "64", "--num-workers", "2", "--epochs", "2", "--num-rows", "100000") == 0
    out = capsys.readouterr().out
    assert "audit data=map: 100000 rows; world 64 x 2 reader(s)" in out
    assert "epoch 1: 195 steps per rank" in out and out.rstrip().endswith("equal steps on every rank")


def test_audit_cli_iterable_counts_lines(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", 3)
    b = write_jsonl(tmp_path / "b.jsonl", 90)
    args = ["data=iterable", "dataset=sharegpt_files", f"dataset.paths=[{a},{b}]", "trainer.max_steps=10"]
    assert audit(*args, "--world-size", "3", "--num-workers", "2", "--epochs", "2") == 0
    out = capsys.readouterr().out
    assert "2 files, 93 lines" in out and "epoch 0: 3 steps per rank" in out  # 93 // (3 x 8)
    assert audit(*args, "data.num_samples=200", "--world-size", "3") == 1
    assert "VIOLATION" in capsys.readouterr().out


def test_audit_agrees_with_the_loaders(tmp_path):
    """Per-rank samples the audit computes == what the real stream loaders yield."""
    from tests.test_strategies import make_stream, run_epoch, write_files

    paths = write_files(tmp_path, [13, 2, 40])
    lay = Layout(3, 2, 1, 2)
    rep = audit_stream([13, 2, 40], lay, 0, True, 8, 2, num_samples=55)
    loaders = [make_stream(paths, 3, r, 2, 2, 1, num_samples=55) for r in range(3)]
    for epoch in range(2):
        out = run_epoch(loaders, epoch)
        assert [sum(len(b) for b in out[r]) for r in range(3)] == rep.epochs[epoch].samples_per_rank
        assert [len(out[r]) for r in range(3)] == rep.epochs[epoch].micro_per_rank


# ---------------------------------------------------------------------------------------------------------------
# Ledger


def fake_run(run_dir, world, steps, per_step, accum=1, duplicate=False, skip_rank_step=False):
    sample = iter(range(10**6))
    for rank in range(world):
        with LedgerWriter(run_dir, rank) as led:
            for step in range(1, steps + 1):
                if skip_rank_step and rank == 1 and step == steps:
                    continue
                for _ in range(accum):
                    ids = [f"s{next(sample)}" for _ in range(per_step)]
                    if duplicate and rank == 1 and step == 2:
                        ids[0] = "s0"
                    led.record(0, step, ids)


def test_ledger_ok_and_expected_ids(tmp_path):
    fake_run(tmp_path, 2, 3, 2, accum=2)
    rep = verify_ledgers(tmp_path, expected_ids=[f"s{i}" for i in range(26)], global_batch=8, complete_epochs=[0])
    assert rep.ok, rep.summary()
    assert rep.steps_per_rank == {0: 3, 1: 3} and rep.samples_per_rank == {0: 12, 1: 12} and rep.missing == {0: 2}
    rep = verify_ledgers(tmp_path, expected_ids=[f"s{i}" for i in range(40)], global_batch=8, complete_epochs=[0])
    assert not rep.ok and "16 samples never read" in rep.summary()


def test_ledger_detects_duplicates_and_unequal_steps(tmp_path):
    fake_run(tmp_path / "a", 2, 3, 2, duplicate=True)
    rep = verify_ledgers(tmp_path / "a")
    assert not rep.ok and "read more than once" in rep.summary()
    fake_run(tmp_path / "b", 2, 3, 2, skip_rank_step=True)
    rep = verify_ledgers(tmp_path / "b")
    assert not rep.ok and "rank 1 ran 2 steps" in rep.summary()
    assert audit("--ledger", str(tmp_path / "b")) == 1
    assert not verify_ledgers(tmp_path / "nothing").ok


def test_ledger_resume_replaces_replayed_steps(tmp_path):
    with LedgerWriter(tmp_path, 0) as led:
        for step in (1, 2, 3):
            led.record(0, step, [f"a{step}"])
    with LedgerWriter(tmp_path, 0) as led:  # resumed from the checkpoint of step 2: step 3 runs again
        led.record(0, 3, ["b3"])
        led.record(0, 4, ["b4"])
    steps = read_ledger(tmp_path / "ledger" / "rank0.jsonl")
    assert steps == {(0, 1): ["a1"], (0, 2): ["a2"], (0, 3): ["b3"], (0, 4): ["b4"]}
    assert audit("--ledger", str(tmp_path)) == 0
