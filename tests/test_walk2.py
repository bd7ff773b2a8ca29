"""Findings of an operational walk through the README (2-rank CPU runs, interruption, elastic resume, ledgers)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from dsrecipes.cli import main as cli_main
from dsrecipes.data.plan.ledger import LedgerWriter, verify_ledgers

REPO = Path(__file__).resolve().parents[1]


def _steps(led: LedgerWriter, rank: int, steps, tag: str, per_step: int = 2) -> None:
    for step in steps:
        led.record(step // 5, step, [f"{tag}{step}.{rank}.{i}" for i in range(per_step)],
                   [f"row{step}-{rank}-{i}-{tag}" for i in range(per_step)])


def test_audit_passes_a_ledger_resumed_at_another_world_size(tmp_path, capsys):
    """README: map/iterable resume at another world size, and `audit --ledger` checks a real run. Was: a run trained
    on 2 ranks, interrupted at step 74 and resumed on 1 rank failed its audit ('VIOLATION rank 1 ran 74 steps, rank 0
    ran 90'): the audit wanted every rank in every step. Also a rank left out of the new world keeps what it recorded
    past the resumed checkpoint (a crash: checkpoint at step 4, steps 5-6 recorded), which the new world replayed."""
    for rank in (0, 1):
        with LedgerWriter(tmp_path, rank, world_size=2) as led:
            _steps(led, rank, range(1, 7), "a")  # steps 5-6 were recorded, the checkpoint is step 4
    with LedgerWriter(tmp_path, 0, world_size=1) as led:  # resumed from step 4 on one rank
        _steps(led, 0, range(5, 10), "b", per_step=4)
    rep = verify_ledgers(tmp_path)
    assert rep.ok, rep.summary()
    assert rep.steps_per_rank == {0: 9, 1: 4} and rep.samples_per_rank == {0: 28, 1: 8}
    assert "another world size (2 -> 1 ranks)" in rep.summary()
    assert cli_main(["audit", "--ledger", str(tmp_path)]) == 0
    assert "OK" in capsys.readouterr().out


def test_audit_still_catches_a_missing_step_and_a_replayed_sample_after_an_elastic_resume(tmp_path):
    """The world-aware check is not a blanket pass: rank 1 missing a step of its own 2-rank world, and the 1-rank
    world reading a sample rank 1 had already trained on in that epoch, are both violations."""
    for rank in (0, 1):
        with LedgerWriter(tmp_path, rank, world_size=2) as led:
            _steps(led, rank, [s for s in range(1, 5) if not (rank == 1 and s == 2)], "a")
    with LedgerWriter(tmp_path, 0, world_size=1) as led:
        led.record(1, 5, ["x"], ["row3-1-0-a"])  # epoch 0 ended at step 4; epoch 1 starts afresh: fine
        led.record(0, 6, ["y"], ["row4-1-0-a"])  # (epoch 0 again) rank 1's step-4 sample, read twice in epoch 0
    summary = verify_ledgers(tmp_path).summary()
    assert "VIOLATION rank 1 ran 3 steps, rank 0 ran 4" in summary
    assert "read more than once" in summary and "row4-1-0-a" in summary


def test_a_rank_session_mark_names_its_world_size(tmp_path):
    """The rank side writes the world size into its ledger's session mark (what the audit above reads)."""
    from dsrecipes.rank.session import open_ledger

    cfg = SimpleNamespace(trainer=SimpleNamespace(record_samples=True))
    open_ledger(cfg, tmp_path, 1, 2).close()
    mark = json.loads((tmp_path / "ledger" / "rank1.jsonl").read_text().splitlines()[0])
    assert mark["world_size"] == 2


def _result(run, steps: int) -> None:
    (run / "result.json").write_text(json.dumps({"status": "ok", "exit_code": 0, "steps": steps}))


def test_audit_fails_a_run_whose_ledger_misses_steps_it_trained(tmp_path, capsys):
    """Was: a run recorded 14 steps, was resumed with trainer.record_samples=false to step 20 (the resume only
    reports 'trainer.record_samples: true -> false'), and `audit --ledger` said OK, exit 0: steps 15-20 were never
    checked. Now it is a violation naming result.json, the count and the steps; a run whose ledger lists every step
    it trained (and a run with no result.json yet) is checked as before."""
    with LedgerWriter(tmp_path, 0, world_size=1) as led:
        _steps(led, 0, range(1, 15), "a")
    _result(tmp_path, 20)
    assert cli_main(["audit", "--ledger", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "the run trained 20 steps, its ledger lists 14: 6 step(s) (15..20) are not in it" in out
    assert "record_samples" in out
    _result(tmp_path, 14)
    assert cli_main(["audit", "--ledger", str(tmp_path)]) == 0
    (tmp_path / "result.json").unlink()
    assert cli_main(["audit", "--ledger", str(tmp_path)]) == 0


def test_the_reshard_command_for_another_world_size_keeps_the_validation_part(tmp_path):
    """Was: a presharded run at a world size other than the shard's part count said 'Re-shard for this world size:
    `dsrecipes shard d.jsonl --parts 1 --out NEW_DIR --balance samples`' for a shard written with --val-size 16:
    that command writes no val.jsonl, so the 16 held-out rows became training rows and the run stopped evaluating.
    Now the command carries --val-size 16, and running it holds out the very same rows (same val.jsonl checksum)."""
    import shlex

    import pytest

    from dsrecipes.core.errors import DataError
    from dsrecipes.data.shard.manifest import read_manifest

    sample = REPO / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
    rows = tmp_path / "d.jsonl"
    rows.write_text("".join(sample.read_text(encoding="utf-8").splitlines(keepends=True)[:40]), encoding="utf-8")
    assert cli_main(["shard", str(rows), "--parts", "2", "--out", str(tmp_path / "s2"), "--val-size", "4"]) == 0
    with pytest.raises(DataError) as err:
        read_manifest(str(tmp_path / "s2"), world_size=1)
    command = str(err.value).split("`")[1]
    assert "--val-size 4" in command, command
    argv = shlex.split(command.replace("NEW_DIR", str(tmp_path / "s1")))
    assert argv[0] == "dsrecipes" and cli_main(argv[1:]) == 0
    assert read_manifest(str(tmp_path / "s1"), 1).val_sha256 == read_manifest(str(tmp_path / "s2")).val_sha256


def test_an_elastic_resume_keeps_deepspeeds_conversion_narrative_off_the_console(tmp_path, monkeypatch, capsys):
    """Was: resuming a 2-rank ZeRO-2 run on 1 rank printed DeepSpeed's 'Convert DeepSpeed Checkpoint to Universal
    Checkpoint', '*** 1. Extracting ZeRO fragments', two tqdm bars and '[WARNING] ... MPU is not provided, setting tp
    size to 1 in checkpoint loading' among the run's own lines (README: such lines go to <run>/logs/). Now the
    conversion prints into the rank's log file, and the MPU warning is noise (a log line)."""
    import sys
    import types

    import dsrecipes.boundary.trust as trust
    import dsrecipes.core.console as console
    from dsrecipes.rank.checkpoint import convert_to_universal
    from tests.test_trust_audit import _foreign_checkpoint

    tag = _foreign_checkpoint(tmp_path, monkeypatch)

    def narrating_conversion(args):  # what ds_to_universal prints while it converts
        print("Convert DeepSpeed Checkpoint to Universal Checkpoint\n*** 1. Extracting ZeRO fragments")
        print("100%|##########| 2/2 [00:00<00:00, 13.51it/s]", file=sys.stderr)
        Path(args.output_folder).mkdir(exist_ok=True)

    monkeypatch.setitem(sys.modules, "deepspeed.checkpoint.ds_to_universal",
                        types.SimpleNamespace(main=narrating_conversion))
    log = tmp_path / "logs" / "rank0.log"
    log.parent.mkdir()
    monkeypatch.setattr(console._SINK, "path", log)
    try:
        convert_to_universal(tag, out=tmp_path / "run" / "universal" / "step_4")
    finally:
        trust.reset()
    shown = capsys.readouterr()
    assert "Extracting ZeRO fragments" not in shown.out + shown.err and "it/s" not in shown.err
    assert "Extracting ZeRO fragments" in log.read_text() and "13.51it/s" in log.read_text()
    assert console.is_noise("[WARNING] [base_optimizer.py:343:load_hp_checkpoint_state_from_checkpoint_dir] MPU is not "
                            "provided, setting tp size to 1 in checkpoint loading.")


def test_a_presharded_resume_on_another_world_size_is_told_the_way_that_works(tmp_path, make_cfg):
    """Was: resuming a 2-part presharded run on 1 rank said 'Re-shard for this world size: `dsrecipes shard ... --parts
    1 --out NEW_DIR ...` and set data.shard_dir=NEW_DIR'; doing so, the resume was refused again ('the training data
    differs ... fingerprint b13e... -> a7ce...'): a dead end. Now, with a checkpoint in the run directory, it says to
    resume on 2 ranks, or to start a new run in another directory on the re-shard; a new run still gets the re-shard."""
    import pytest

    from dsrecipes.core.errors import DataError
    from dsrecipes.data.strategies import strategy_of

    sample = REPO / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
    rows = tmp_path / "d.jsonl"
    rows.write_text("".join(sample.read_text(encoding="utf-8").splitlines(keepends=True)[:20]), encoding="utf-8")
    assert cli_main(["shard", str(rows), "--parts", "2", "--out", str(tmp_path / "s2")]) == 0
    cfg = make_cfg("data=presharded", f"data.shard_dir={tmp_path / 's2'}", check_files=False)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(DataError, match="Re-shard for this world size"):  # a new run: the re-shard is the way
        strategy_of(cfg).prepare(cfg, run, None, 1)
    (run / "checkpoints" / "step_8").mkdir(parents=True)
    with pytest.raises(DataError) as err:
        strategy_of(cfg).prepare(cfg, run, None, 1)
    assert "resume on 2 ranks" in str(err.value) and "another trainer.output_dir" in str(err.value)
