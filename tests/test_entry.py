"""The launching process: bad data stops the run before any rank starts; the run directory it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.data.stream.scan import scan_stream
from tests.conftest import subprocess_env

ROWS = [
    '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}',
    '{"conversations": 5}',
    "not json",
    '{"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}',
]


@pytest.fixture
def stream(tmp_path):
    path = tmp_path / "shard.jsonl"
    path.write_text("\n".join(ROWS) + "\n", encoding="utf-8")
    return path


def test_iterable_bad_row_stops_before_any_rank(tmp_path, stream):
    out = subprocess.run(
        [sys.executable, "-m", "dsrecipes", "data=iterable", f"dataset.paths=[{stream}]", "trainer.max_steps=2",
         "scheduler.warmup_steps=0", f"trainer.output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, cwd=tmp_path, env=subprocess_env(), timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().endswith(
        f"error: {stream}:2: conversation_not_list ('conversations' is a int); "
        "set dataset.bad_rows=skip to quarantine bad rows")
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "ds_config.json").exists(), "nothing is launched after bad data"
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "failed" and result["exit_code"] == 2


def test_iterable_skip_quarantines_and_enforces_the_fraction(make_cfg, tmp_path, stream):
    cfg = make_cfg("data=iterable", f"dataset.paths=[{stream}]", "trainer.max_steps=2", "scheduler.warmup_steps=0",
                   "dataset.bad_rows=skip", "dataset.max_bad_fraction=0.5")
    assert scan_stream(cfg, tmp_path) == {"rows": 4, "good": 2, "skipped": 2}
    lines = [json.loads(x) for x in (tmp_path / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["line"], q["reason"]) for q in lines] == [(2, "conversation_not_list"), (3, "invalid_json")]
    strict = make_cfg("data=iterable", f"dataset.paths=[{stream}]", "trainer.max_steps=2", "scheduler.warmup_steps=0",
                      "dataset.bad_rows=skip", "dataset.max_bad_fraction=0.25")
    with pytest.raises(DataError, match=r"2 of 4 rows are bad \(50.0% > dataset.max_bad_fraction=0.25\)"):
        scan_stream(strict, tmp_path)
