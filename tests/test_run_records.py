"""Run-directory records read back (issue 50 item 3, fast): a damaged metrics.jsonl, result.json or plan.json is one
message naming the file (and line), never a traceback; only a last line cut short by a kill is skipped."""

from __future__ import annotations

import json
import re

import pytest

from dsrecipes.core.errors import UserError
from dsrecipes.core.rundir import read_metrics, write_result
from dsrecipes.core.runplan import read_plan
from dsrecipes.observe.sweep import read_run

ROWS = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]


def _metrics(tmp_path, tail: bytes) -> None:
    (tmp_path / "metrics.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in ROWS) + tail)


def test_a_last_line_cut_short_is_skipped(tmp_path):
    _metrics(tmp_path, b'{"step": 3, "lo')
    assert read_metrics(tmp_path) == ROWS


@pytest.mark.parametrize("bad", [b"{oops", b"[1]", b'{"step": "3"}', b"\xff"])
def test_a_damaged_line_is_named_by_file_and_line(tmp_path, bad):
    _metrics(tmp_path, bad + b"\n")
    with pytest.raises(UserError, match=r"metrics.jsonl:3: not a metrics record"):
        read_metrics(tmp_path)
    write_result(tmp_path, 1, "it failed")  # still written, the damage named beside the run's own error
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "failed" and "metrics.jsonl:3" in result["metrics_error"]
    row = read_run(tmp_path)  # a sweep table names it in this job's row
    assert row["status"] == "failed" and "metrics.jsonl:3" in row["error"]


@pytest.mark.parametrize("text", ["[]", "\udcff", "{"])
def test_a_damaged_result_or_plan_is_one_message(tmp_path, text):
    (tmp_path / "result.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    row = read_run(tmp_path)
    assert row["status"] == "failed" and "result.json" in row["error"]
    (tmp_path / "plan.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(UserError, match="plan.json: unreadable run plan"):
        read_plan(tmp_path)


def test_a_huge_metrics_file_or_line_is_one_message_without_reading_it_whole(tmp_path):
    """A shared or damaged run directory with a metrics.jsonl over metrics_file.MAX_METRICS_BYTES (here a sparse file of
    zeros) or one endless line. Was: read whole into memory (path.read_bytes), then skipped as 'a last line cut
    short' (0 rows, the damage unsaid); now one message naming the file (and line), after at most one bounded line."""
    import os

    from dsrecipes.core import metrics_file

    metrics = tmp_path / "metrics.jsonl"
    _metrics(tmp_path, b"")
    with open(metrics, "ab") as fh:
        fh.truncate(metrics_file.MAX_METRICS_BYTES + 1)  # sparse: no disk, no memory
    with pytest.raises(UserError, match=rf"^{re.escape(str(metrics))}: more than 512 MiB, more than dsrecipes reads"):
        read_metrics(tmp_path)
    _metrics(tmp_path, b'{"step": 3, "note": "' + b"x" * (2 << 20) + b'"}\n')
    with pytest.raises(UserError, match=rf"^{re.escape(str(metrics))}:3: a line of more than 1 MiB, not a metrics record"):
        read_metrics(tmp_path)
    _metrics(tmp_path, b'{"step": 3, "note": "' + b"x" * 1000 + b'"}\n')  # long, within the bound: still a record
    assert len(read_metrics(tmp_path)) == 3 and os.path.getsize(metrics) < metrics_file.MAX_METRICS_LINE


def test_a_huge_ds_config_is_one_message_naming_it(tmp_path):
    """ds_config.json of 2 MiB (valid JSON). Was: read whole and used as the DeepSpeed config; now one message
    naming the file, never read into memory past rundir.MAX_DS_CONFIG_BYTES."""
    from dsrecipes.core.rundir import DS_CONFIG_FILE, read_ds_config, write_ds_config

    write_ds_config(tmp_path, {"train_batch_size": 8})
    assert read_ds_config(tmp_path) == {"train_batch_size": 8}
    (tmp_path / DS_CONFIG_FILE).write_text(json.dumps({"train_batch_size": 8, "pad": "x" * (2 << 20)}))
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path / DS_CONFIG_FILE))}: larger than 1048576 bytes, not the DeepSpeed"):
        read_ds_config(tmp_path)
