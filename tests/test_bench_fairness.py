"""The benchmarks that compare two sides measure both alike: the same timed quantity, the same window, alternated.

Fast checks of the harness functions that turn each side's raw numbers into its result (benchmarks/*.py), without
running a benchmark (tests/test_benchmarks_smoke.py runs every script's --smoke).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def bench():
    """Import a benchmark module by name; sys.path and PYTHONPATH (which benchmarks/_harness.py extends) restored."""
    saved_path, saved_env = list(sys.path), os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_env


def test_gpu_compare_dsrecipes_rate_is_its_tokens_over_its_time_as_trls_is(bench):
    """TRL's and the bare loop's tokens/s are all tokens over all time of the steady window; dsrecipes' was the mean
    of its log windows' rates, which counts a short fast window as much as a long slow one (here 550 vs 181.8)."""
    gc = bench("gpu_compare")
    rows = [{"step": 4, "tokens_per_s": 100.0, "elapsed": 1.0}, {"step": 8, "tokens_per_s": 100.0, "elapsed": 2.0},
            {"step": 8, "eval_loss": 1.0},  # an eval line: no rate
            {"step": 12, "tokens_per_s": 1000.0, "elapsed": 3.0},  # 1000 tokens in 1 s
            {"step": 16, "tokens_per_s": 100.0, "elapsed": 13.0}]  # 1000 tokens in 10 s
    assert gc.steady_tokens_per_s(rows, after_step=8) == pytest.approx(2000 / 11)
    assert gc.steady_tokens_per_s(rows[:1], after_step=0) == 100.0  # a dry run's single window
    assert gc.steady_tokens_per_s([], after_step=0) is None
