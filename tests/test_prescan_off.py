"""data=iterable with `data.prescan=false` (no row read before training) says what it does not give, and tells the
truth about the bad row it stops at. Was: `bad_rows=error` stopped mid-run at a bad row met in the epoch's shuffled
order (line 31 of a file whose first bad line is 4, which data=map and the pre-scan name) with the same words as a
scan's refusal and its advice to quarantine; `bad_rows=skip` trained on without a quarantine, a count or
dataset.max_bad_fraction, and GRPO's missing-reference note and refusal were not given: all of it silent.

Each gap needs the whole scan that prescan=false exists to avoid, so the launch names those that apply to the run
(stream/unscanned.py), and a bad row met mid-run is named as the first that reading met (file:line: reason)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.config.load import compose_and_load
from dsrecipes.core.errors import DataError
from dsrecipes.data.sources.badrows import BadReason, BadRow, error_message
from dsrecipes.data.stream.scan import prepare_stream
from dsrecipes.data.stream.unscanned import TRAINING, met_unscanned
from tests.conftest import subprocess_env

BAD = (4, 7, 18, 31)  # lines of bad rows; the first one (4) is what data=map names
FAST = ["debug=fast", "dataset.val_size=0", "trainer.max_steps=4", "trainer.save_every=0", "trainer.eval_every=0"]
GRPO = ["objective=grpo", "data.cutoff_len=48", "objective.max_completion_length=6", "objective.num_generations=2",
        "dataset.val_size=0"]


def bad_rows(path: Path, n: int = 40) -> Path:
    rows = [json.dumps({"conversations": f"broken {i}"}) if i in BAD else
            json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}],
                        "id": f"r{i}"}) for i in range(1, n + 1)]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    run = tmp_path / "run"
    return subprocess.run([sys.executable, "-m", "dsrecipes", "train", *FAST, f"trainer.output_dir={run}",
                           f"data.cache_dir={tmp_path / 'cache'}", *overrides], capture_output=True, text=True,
                          cwd=tmp_path, env=subprocess_env(), timeout=300)


def test_error_names_the_row_training_met_as_such_and_the_launch_said_it(tmp_path):
    """A real run, 2 DataLoader workers: the map run names line 4 before training; the unscanned stream stops
    mid-run at the bad row a worker met, says it is the first that reading met (not the stream's), and offers no
    quarantine it would not write; exit 2, one message."""
    data = bad_rows(tmp_path / "bad.jsonl")
    out = train(tmp_path, "data=iterable", "data.prescan=false", "data.num_workers=2", f"dataset.paths=[{data}]",
                "dataset.bad_rows=error")
    err = out.stderr
    assert out.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert re.search(r"note: data\.prescan=false: rows are checked only as training reads them, so a bad row stops "
                     r"the run mid-training .* not necessarily the stream's first bad row", err), err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]
    met = re.match(rf"error: {re.escape(str(data))}:(\d+): conversation_not_list \('conversations' is a str\); the "
                   r"first bad row rank 0 met in its training rows, read in the epoch's shuffled order: with "
                   r"data\.prescan=false rows are checked only as training reads them, so an earlier line of the "
                   r"stream may be bad too", line)
    assert met and int(met.group(1)) in BAD, line
    assert "to quarantine bad rows" not in line and "no <run>/quarantine.jsonl" in line, line


def test_skip_says_at_launch_that_no_quarantine_or_fraction_is_kept(tmp_path):
    """10% bad rows: data=map refuses them (above max_bad_fraction, with its quarantine); the unscanned stream
    trains, and its launch said beforehand that it keeps neither."""
    data = bad_rows(tmp_path / "bad.jsonl")
    out = train(tmp_path, "data=iterable", "data.prescan=false", f"dataset.paths=[{data}]", "dataset.bad_rows=skip")
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("note: data.prescan=false: rows are checked only as training reads them, so bad rows are skipped as "
            "training meets them, with no <run>/quarantine.jsonl, no count and no dataset.max_bad_fraction=0.05 "
            "check. data.prescan=true checks every row before training") in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "run" / "quarantine.jsonl").exists()


def prepare(tmp_path: Path, *overrides: str):
    """The launching process's part of data=iterable (index; the scan when data.prescan is on)."""
    cfg = compose_and_load(["data=iterable", f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return prepare_stream(cfg, run)


def test_grpo_without_the_scan_says_references_are_not_counted(tmp_path, capsys):
    """Prompts without a reference under a reward that compares with it: the scan refuses them; without it the
    launch says that nothing counts them (nor refuses a stream with none), and only where a reward needs them."""
    data = tmp_path / "none.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"{i}+1="}],
                                        "ground_truth": i + 1}) + "\n" for i in range(8)))
    rewards = "objective.rewards=[{name: exact_match}, {name: length, max_chars: 4}]"
    with pytest.raises(DataError, match="8 of 8 prompt rows have no reference answer"):
        prepare(tmp_path, *GRPO, f"dataset.paths=[{data}]", "objective.rewards=[{name: exact_match}]")
    prepare(tmp_path, *GRPO, f"dataset.paths=[{data}]", rewards, "data.prescan=false")
    err = capsys.readouterr().err
    assert "so a bad row stops the run mid-training" in err, err
    assert ("; prompt rows without a reference answer (which objective.rewards exact_match compare with) are neither "
            "counted nor said, and a stream with none is not refused") in err, err
    prepare(tmp_path, *GRPO, f"dataset.paths=[{data}]", "objective.rewards=[{name: length, max_chars: 4}]",
            "data.prescan=false")
    assert "reference" not in capsys.readouterr().err  # no reward compares with one: nothing to say
    prepare(tmp_path, *GRPO, f"dataset.paths=[{data}]", "objective.rewards=[{name: length, max_chars: 4}]")
    assert "prescan" not in capsys.readouterr().err


def test_an_empty_file_skipped_without_the_scan_is_said(tmp_path, capsys):
    """The index knows a file without rows: said at launch under skip (the scan would quarantine it)."""
    data = bad_rows(tmp_path / "bad.jsonl", 8)
    (tmp_path / "empty.jsonl").write_text("\n")
    prepare(tmp_path, f"dataset.paths=[{data},{tmp_path / 'empty.jsonl'}]", "dataset.val_size=0",
            "dataset.max_samples=null", "data.prescan=false", "dataset.bad_rows=skip")
    assert f"data: {tmp_path / 'empty.jsonl'}: empty_file (no rows): skipped (dataset.bad_rows=skip)" in \
        capsys.readouterr().err


def test_a_row_of_another_kind_keeps_its_advice():
    """The refusal of a preference pair where conversations are read keeps what reads it; the quarantine advice
    alone is replaced."""
    pair = BadRow(BadReason.invalid_json, "x", advice="objective=dpo reads pairs")
    other = error_message("p.jsonl:3", pair)
    said = error_message("p.jsonl:3", pair, met_unscanned(1, TRAINING))
    assert said.startswith(f"{other}; the first bad row rank 1 met") and "bad_rows=skip" not in said
    own = error_message("p.jsonl:3", BadRow(BadReason.invalid_json, "x"), met_unscanned(0, TRAINING))
    assert own.startswith("p.jsonl:3: invalid_json (x); the first bad row rank 0 met") and "to quarantine" not in own
