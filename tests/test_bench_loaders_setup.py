"""benchmarks/bench_loaders.py counts a reader's setup (the launch part and build_loaders: map's prepare on a cold
cache, iterable's index and pre-scan) and the CPU of its workers, so that a reader whose tokenization happened
before its epoch is not compared with a plain loop that tokenizes inside it on the epoch alone.

Fast checks of the functions that time and summarise (tests/test_benchmarks_smoke.py runs the script's --smoke).
"""

from __future__ import annotations

import time

import pytest

from tests.test_bench_fairness import bench  # noqa: F401  (the fixture: a benchmark module, sys.path restored)


@pytest.fixture()
def bench_loaders(bench):  # noqa: F811
    return bench("bench_loaders")


def test_a_readers_setup_is_timed_apart_from_its_epoch_and_counted_in_its_with_setup_rate(bench_loaders):
    """The old measure() got an already built loader: map's prepare (a cold cache) or iterable's pre-scan, done while
    building it, was in no number, while the plain loop's tokenization was in its epoch."""
    def make():
        time.sleep(0.3)  # the work done before the first batch (prepare, index, pre-scan)
        return [{"ids": ["a", "b"], "num_tokens": 10}] * 5

    got = bench_loaders.measure(make)
    assert got["samples"] == 10 and got["setup_s"] >= 0.29
    assert got["with_setup_samples_per_s"] <= 10 / 0.29 < got["samples_per_s"]
    assert "cpu_s" in got and "samples_per_cpu_s" in got


def test_every_rate_is_compared_with_the_plain_loop_of_the_same_repetition(bench_loaders):
    plain = bench_loaders.PLAIN
    base = {"samples": 100, "tokens_per_s": 9, "setup_s": 0.0}
    runs = [{"strategy": plain, "workers": 0, "rep": 0, **base, "samples_per_s": 1000,
             "with_setup_samples_per_s": 1000, "samples_per_cpu_s": 1000},
            {"strategy": "map", "workers": 0, "rep": 0, **base, "samples_per_s": 3000, "setup_s": 1.0,
             "with_setup_samples_per_s": 500, "samples_per_cpu_s": 3000},
            {"strategy": "map", "workers": 0, "rep": 1, **base, "samples_per_s": 1500, "setup_s": 2.0,
             "with_setup_samples_per_s": 250, "samples_per_cpu_s": 1500},
            {"strategy": plain, "workers": 0, "rep": 1, **base, "samples_per_s": 500,
             "with_setup_samples_per_s": 500, "samples_per_cpu_s": 500}]
    row = {r["strategy"]: r for r in bench_loaders.summary(runs)}["map"]
    assert row["vs_plain"] == 3.0 and row["vs_plain_with_setup"] == 0.5 and row["vs_plain_per_cpu_s"] == 3.0
    assert row["vs_plain_with_setup_range"] == [0.5, 0.5] and row["setup_s"] == 1.5
