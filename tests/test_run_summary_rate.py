"""A run's headline tokens/s (result.json, the report line, sweep summaries) is its windows' tokens over their time.

Was: core/rundir.run_summary took the plain mean of the log windows' rates, so a short fast window weighed as much as
a long slow one: windows (step 4, 100 tok/s), (8, 100 tok/s), (12, 1000 tok/s) of 400 tokens each summarised as 550
tokens/s where the two windows after the first ran 800 tokens in 4.4 s (182 tokens/s).
"""

from __future__ import annotations

import json

import pytest

from dsrecipes.core.metrics_file import mean_rate
from dsrecipes.core.rundir import run_summary
from dsrecipes.observe.metrics import MetricsLogger


def _write(run_dir, rows):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_windows_weigh_by_their_tokens(tmp_path):
    _write(tmp_path, [{"step": 4, "loss": 1.0, "tokens_per_s": 100.0, "tokens": 400},
                      {"step": 8, "loss": 1.0, "tokens_per_s": 100.0, "tokens": 400},
                      {"step": 12, "loss": 1.0, "tokens_per_s": 1000.0, "tokens": 400}])
    assert run_summary(tmp_path)["tokens_per_s"] == pytest.approx(800 / (4 + 0.4))


def test_unequal_windows_use_their_own_tokens():
    rows = [{"step": 1, "tokens_per_s": 10.0, "tokens": 10},  # the first window: warm-up, left out
            {"step": 2, "tokens_per_s": 50.0, "tokens": 1000}, {"step": 3, "tokens_per_s": 500.0, "tokens": 10}]
    assert mean_rate(rows) == pytest.approx(1010 / (20 + 0.02))


def test_lines_without_tokens_weigh_by_their_steps():
    """metrics.jsonl of runs before the `tokens` field: windows of 4 and 8 steps, equal tokens per step."""
    rows = [{"step": 2, "tokens_per_s": 1.0}, {"step": 6, "tokens_per_s": 100.0}, {"step": 14, "tokens_per_s": 200.0}]
    assert mean_rate(rows) == pytest.approx(12 / (4 / 100 + 8 / 200))


def test_one_window_and_none():
    assert mean_rate([{"step": 3, "tokens_per_s": 42.0, "tokens": 7}]) == pytest.approx(42.0)
    assert mean_rate([]) is None
    assert mean_rate([{"step": 3, "tokens_per_s": None}]) is None


def test_the_logger_writes_the_windows_tokens(tmp_path):
    log = MetricsLogger(tmp_path, rank=0, total_steps=1, bar=False)
    log.log_train(step=1, loss=1.0, lr=1e-3, grad_norm=None, tokens_per_s=5.0, samples_seen=1, elapsed=1.0, tokens=17)
    log.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["tokens"] == 17 and row["tokens_per_s"] == 5.0
