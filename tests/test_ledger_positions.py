"""The sample ledger's exactly-once check counts the positions each strategy dealt (`keys`), not sample ids.

Ids need not be unique: two files named `train.jsonl` in different folders give the same default ids
(`train.jsonl:1`), and data sets repeat their `id` column. Before `keys`, `dsrecipes audit --ledger` reported such a
correct run as "40 ids read more than once" (exit 1). A real run of each strategy on such data must audit OK, and a
position dealt twice must still be a violation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.cli import main as cli_main
from dsrecipes.data.plan.ledger import LedgerWriter, read_ledger, verify_ledgers
from tests.conftest import in_process_environ

ROWS = 12  # per file; micro batch 4 (debug=fast), 1 rank: 6 steps read both files once


def write_same_named(root: Path, file: str, rows: int) -> None:
    """a/FILE and b/FILE, `rows` rows each without an id: their default ids collide (`FILE:N`), their texts differ."""
    for k, name in enumerate(("a", "b")):
        (root / name).mkdir(parents=True)
        with open(root / name / file, "w") as fh:
            for i in range(rows):
                fh.write(json.dumps({"conversations": [{"from": "human", "value": f"{name} question {i}?"},
                                                       {"from": "gpt", "value": f"answer {k * rows + i}."}]}) + "\n")


def same_named_files(root: Path) -> str:
    """a/train.jsonl and b/train.jsonl (write_same_named) as two sources."""
    write_same_named(root, "train.jsonl", ROWS)
    return f"dataset.sources=[{{name: a, paths: [{root}/a/train.jsonl]}},{{name: b, paths: [{root}/b/train.jsonl]}}]"


@pytest.mark.parametrize("strategy", ["map", "iterable", "presharded"])
def test_a_run_over_same_named_files_audits_ok(tmp_path, capsys, strategy):
    sources = same_named_files(tmp_path / "data")
    data = [f"data={strategy}"]
    if strategy == "presharded":
        with in_process_environ():
            assert cli_main(["shard", "--parts", "1", "--out", str(tmp_path / "parts"), "debug=fast", sources,
                             "dataset.val_size=0"]) == 0
        data += [f"data.shard_dir={tmp_path / 'parts'}"]
    else:
        data += [sources, "dataset.val_size=0"]
    run = tmp_path / "run"
    with in_process_environ():
        assert cli_main(["debug=fast", *data, "trainer.record_samples=true", f"trainer.output_dir={run}",
                         f"hydra.run.dir={run}", f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=6",
                         "trainer.save_every=0", "trainer.eval_every=0", "launcher=local"]) == 0
    ids = [i for step_ids in read_ledger(run / "ledger" / "rank0.jsonl").values() for i in step_ids]
    assert len(ids) == 2 * ROWS and len(set(ids)) == ROWS  # every sample once; each id names two of them
    capsys.readouterr()
    assert cli_main(["audit", "--ledger", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "OK" in shown and "12 ids name more than one sample" in shown and "VIOLATION" not in shown, shown


def write(run: Path, rank: int, steps):
    with LedgerWriter(run, rank) as led:
        for step, ids, keys in steps:
            led.record(0, step, ids, keys)


def test_a_position_dealt_twice_is_a_violation_however_the_ids_look(tmp_path):
    write(tmp_path / "ok", 0, [(1, ["x", "x"], ["a.jsonl:1", "b.jsonl:1"])])
    write(tmp_path / "ok", 1, [(1, ["y", "z"], ["a.jsonl:2", "b.jsonl:2"])])
    rep = verify_ledgers(tmp_path / "ok")
    assert rep.ok and rep.notes, rep.summary()

    write(tmp_path / "twice", 0, [(1, ["x", "y"], ["a.jsonl:1", "a.jsonl:2"])])
    write(tmp_path / "twice", 1, [(1, ["u", "v"], ["a.jsonl:1", "b.jsonl:2"])])  # unique ids, one position twice
    rep = verify_ledgers(tmp_path / "twice")
    assert not rep.ok and "1 samples (file:line, or row of the prepared data) read more than once" in rep.summary()
    assert rep.duplicates == {0: ["a.jsonl:1"]}


def test_a_ledger_without_positions_is_checked_by_its_ids(tmp_path):
    """A ledger written before `keys` (or one line of a step without them): the ids are all there is to count."""
    write(tmp_path, 0, [(1, ["x", "y"], None)])
    write(tmp_path, 1, [(1, ["x", "z"], ["b.jsonl:1", "b.jsonl:2"])])
    rep = verify_ledgers(tmp_path)
    assert not rep.ok and "1 ids read more than once" in rep.summary()


def test_a_ledger_line_with_keys_that_are_not_names_is_refused(tmp_path):
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "rank0.jsonl").write_text('{"epoch": 0, "step": 1, "ids": ["x"], "keys": [[1]]}\n')
    assert cli_main(["audit", "--ledger", str(tmp_path)]) == 2


def test_prompt_eval_never_scores_a_trained_conversation_as_held_out(tmp_path, capsys):
    """prompt-eval finds the run's validation conversations by id. An id that names a held-out conversation and a
    trained one (b/train.jsonl:N is also a/train.jsonl:N) was matched to the first in data order: a trained
    conversation scored as held out. Such ids are now left out, and said."""
    from dsrecipes.core.errors import UserError
    from dsrecipes.serve.prompt_eval import validation_rows

    sources = same_named_files(tmp_path / "data")
    lines = (tmp_path / "data" / "b" / "train.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "data" / "b" / "train.jsonl").write_text("".join(lines[:4]))  # ids train.jsonl:1-4 name two samples
    run = tmp_path / "run"
    with in_process_environ():
        assert cli_main(["debug=fast", sources, "dataset.val_size=8", "trainer.record_samples=true",
                         f"trainer.output_dir={run}", f"hydra.run.dir={run}", f"data.cache_dir={tmp_path / 'cache'}",
                         "trainer.max_steps=1", "trainer.save_every=0", "trainer.eval_every=0", "launcher=local"]) == 0
    capsys.readouterr()
    rows = validation_rows(run)
    shown = capsys.readouterr().out
    titles = [row.title for row in rows]
    assert rows and not any(f"[train.jsonl:{n}]" in t for t in titles for n in range(1, 5)), titles
    assert "validation ids name more than one conversation" in shown and "left out" in shown, shown

    (tmp_path / "data" / "a" / "train.jsonl").write_text("".join(lines[:4]))  # now every id names two samples
    run2 = tmp_path / "run2"
    with in_process_environ():
        assert cli_main(["debug=fast", sources, "dataset.val_size=2", f"trainer.output_dir={run2}",
                         f"hydra.run.dir={run2}", f"data.cache_dir={tmp_path / 'cache'}", "trainer.max_steps=1",
                         "trainer.save_every=0", "trainer.eval_every=0", "launcher=local"]) == 0
    with pytest.raises(UserError, match="no held-out conversation can be told apart"):
        validation_rows(run2)
