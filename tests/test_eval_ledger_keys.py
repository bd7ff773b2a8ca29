"""The evaluation ledger counts the positions each evaluation dealt (`keys`), and `dsrecipes audit --ledger` checks it.

Validation ids need not be unique: two files named `valid.jsonl` in different folders give the same default ids
(`valid.jsonl:1`). Before `keys`, the evaluation ledger held ids only, `verify_eval_ledgers` said such an
evaluation had scored those samples "more than once", `audit --ledger` never read the evaluation ledger at all, and a
garbage or oversized line was json's traceback (the file was read whole). Now a real run over such files audits OK
(the colliding ids a note), a position scored twice is a violation (exit 1), a bad line is one message naming
file:line (exit 2), and on 2 ranks every strategy's evaluation loaders deal disjoint positions covering the rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.cli import main as cli_main
from dsrecipes.data.plan.ledger import LedgerWriter
from dsrecipes.rank.evaluation import verify_eval_ledgers
from tests.conftest import in_process_environ
from tests.test_ledger_positions import write_same_named

ROWS = 4  # per validation file


def same_named_val_files(root: Path) -> str:
    """a/valid.jsonl and b/valid.jsonl (test_ledger_positions.write_same_named) as the validation files."""
    write_same_named(root, "valid.jsonl", ROWS)
    return f"dataset.val_paths=[{root}/a/valid.jsonl,{root}/b/valid.jsonl]"


@pytest.mark.parametrize("strategy", ["map", "iterable"])
def test_a_run_evaluating_same_named_files_audits_ok(tmp_path, capsys, strategy):
    val = same_named_val_files(tmp_path / "data")
    run = tmp_path / "run"
    with in_process_environ():
        assert cli_main(["debug=fast", f"data={strategy}", val, "dataset.max_samples=16", "dataset.val_size=0",
                         "trainer.record_samples=true", f"trainer.output_dir={run}", f"hydra.run.dir={run}",
                         f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=1", "trainer.save_every=0",
                         "trainer.eval_every=0", "trainer.export=false", "launcher=local"]) == 0
    lines = [json.loads(x) for x in (run / "ledger" / "eval_rank0.jsonl").read_text().splitlines()]
    scored = [rec for rec in lines if "step" in rec]
    assert [rec["step"] for rec in scored] == [0, 1], lines  # the start and the end
    for rec in scored:
        assert len(rec["ids"]) == 2 * ROWS and len(set(rec["ids"])) == ROWS, rec  # each id names two samples
        assert sorted(rec["keys"]) == sorted(f"row{i}" for i in range(2 * ROWS)), rec
    assert verify_eval_ledgers(run) == []
    capsys.readouterr()
    assert cli_main(["audit", "--ledger", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "evaluation ledger: 1 rank(s), 2 evaluation(s)" in shown, shown
    assert f"{ROWS} ids name more than one sample" in shown and "VIOLATION" not in shown, shown
    assert shown.rstrip().endswith("OK"), shown


def a_training_ledger(run: Path) -> None:
    for rank in (0, 1):
        with LedgerWriter(run, rank) as led:
            led.record(0, 1, [f"t{rank}"], [f"row{rank}"])


def eval_ledger(run: Path, rank: int, *records: dict) -> Path:
    """`eval_rank<rank>.jsonl` written by hand, as a run writes it: a session mark, then the records."""
    path = run / "ledger" / f"eval_rank{rank}.jsonl"
    path.write_text("".join(json.dumps(rec) + "\n" for rec in ({"session": 1.0, "pid": 1}, *records)))
    return path


def test_a_position_scored_twice_is_a_violation_of_the_audit(tmp_path, capsys):
    a_training_ledger(tmp_path)
    eval_ledger(tmp_path, 0, {"step": 0, "ids": ["v.jsonl:1", "v.jsonl:2"], "keys": ["row0", "row1"]})
    eval_ledger(tmp_path, 1, {"step": 0, "ids": ["v.jsonl:3", "v.jsonl:4"], "keys": ["row1", "row2"]})  # row1 twice
    capsys.readouterr()
    assert cli_main(["audit", "--ledger", str(tmp_path)]) == 1
    shown = capsys.readouterr().out
    assert "VIOLATION evaluation at step 0: 1 samples (rows of the validation data) scored more than once, e.g. " \
           "['row1']" in shown, shown
    assert "FAILED (1 problems)" in shown, shown


@pytest.mark.parametrize("line", ["{garbage\n", "[" * 100_000 + "\n", '{"step": 0, "ids": ["a"], "keys": [[1]]}\n',
                                  '{"step": 0, "ids": ["' + "x" * (65 << 20) + '"]}\n'],
                         ids=["not-json", "too-deep", "keys-not-names", "oversized"])
def test_a_bad_evaluation_ledger_line_is_one_message_naming_it(tmp_path, capsys, line):
    a_training_ledger(tmp_path)
    with open(eval_ledger(tmp_path, 0, {"step": 0, "ids": ["a"], "keys": ["row0"]}), "a") as fh:
        fh.write(line)
    capsys.readouterr()
    assert cli_main(["audit", "--ledger", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "eval_rank0.jsonl:3: not a ledger record" in err, (out + err)[-2000:]
    assert len((out + err).splitlines()) < 40, (out + err)[-2000:]


def test_an_oversized_training_ledger_line_is_one_message_too(tmp_path, capsys):
    """The training ledger is read by the same bounded reader: a line of more than 64 MiB is never parsed."""
    a_training_ledger(tmp_path)
    with open(tmp_path / "ledger" / "rank1.jsonl", "a") as fh:
        fh.write('{"epoch": 0, "step": 1, "ids": ["' + "x" * (65 << 20) + '"]}\n')
    capsys.readouterr()
    assert cli_main(["audit", "--ledger", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "rank1.jsonl:3: not a ledger record (a line of more than 64 MiB)" in err, (out + err)[-2000:]


@pytest.mark.parametrize("strategy", ["map", "iterable", "presharded"])
def test_two_ranks_are_dealt_disjoint_positions_that_cover_the_validation_rows(tmp_path, make_cfg, strategy):
    """What each rank's evaluation loader deals on 2 ranks (iterable and presharded cut the share before making rows:
    their keys start at the share's first place, else both ranks would say row0..row3)."""
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    data = ["dataset.max_samples=16"]
    if strategy == "presharded":
        with in_process_environ():
            assert cli_main(["shard", "--parts", "2", "--out", str(tmp_path / "parts"), "debug=fast", *data,
                             "dataset.val_size=0"]) == 0
        data = [f"data.shard_dir={tmp_path / 'parts'}"]
    cfg = make_cfg("debug=fast", f"data={strategy}", same_named_val_files(tmp_path / "data"), *data,
                   "dataset.val_size=0", f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=1")
    plan = plan_like_launcher(cfg, tmp_path / "run", 2)
    tok = load_tokenizer(cfg)
    dealt = [[(i, k) for batch in build_loaders(cfg, tok, rank, 2, tmp_path / "run", plan)[1]
              for i, k in zip(batch["ids"], batch["keys"], strict=True)] for rank in (0, 1)]
    assert [len(d) for d in dealt] == [ROWS, ROWS], dealt
    assert sorted(k for d in dealt for _, k in d) == sorted(f"row{n}" for n in range(2 * ROWS)), dealt
    assert len({i for d in dealt for i, _ in d}) == ROWS  # the ids collide, the positions do not
