"""The benchmarks that compare two sides measure both alike: the same timed quantity, the same window, alternated.

Fast checks of the harness functions that turn each side's raw numbers into its result (benchmarks/*.py), without
running a benchmark (tests/test_benchmarks_smoke.py runs every script's --smoke).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import types
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
    rate, spread = gc.steady_tokens_per_s(rows, after_step=8)
    assert rate == pytest.approx(2000 / 11) and spread == [100.0, 1000.0]
    assert gc.steady_tokens_per_s(rows[:1], after_step=0) == (None, None)  # one line: no window, no number
    assert gc.steady_tokens_per_s([], after_step=0) == (None, None)


def test_bench_loaders_compares_each_reader_with_the_plain_loop_of_its_own_repetition(bench):
    """A repetition on a machine twice as loaded halves every reader alike: the ratio to the plain loop of the same
    repetition stays, where a ratio of medians taken from different repetitions (or a single run) would not."""
    bl = bench("bench_loaders")
    runs = [{"strategy": bl.PLAIN, "workers": 0, "rep": 0, "samples": 100, "samples_per_s": 1000, "tokens_per_s": 9},
            {"strategy": "map", "workers": 0, "rep": 0, "samples": 50, "samples_per_s": 2000, "tokens_per_s": 9},
            {"strategy": "map", "workers": 0, "rep": 1, "samples": 50, "samples_per_s": 1000, "tokens_per_s": 9},
            {"strategy": bl.PLAIN, "workers": 0, "rep": 1, "samples": 100, "samples_per_s": 500, "tokens_per_s": 9}]
    rows = {r["strategy"]: r for r in bl.summary(runs)}
    assert rows["map"]["vs_plain"] == 2.0 and rows["map"]["vs_plain_range"] == [2.0, 2.0]
    assert rows["map"]["samples_per_s"] == 1500 and rows["map"]["samples_per_s_range"] == [1000, 2000]
    assert rows[bl.PLAIN]["reps"] == 2


def test_bench_packing_alternates_which_mode_runs_first(bench):
    """Padded always ran first (one run, no spread): now each repetition reverses the order of the last."""
    bp = bench("bench_packing")
    assert [bp.modes_in(rep) for rep in range(3)] == [(False, True), (True, False), (False, True)]
    assert bp.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "range": [1.0, 3.0]}


def test_bench_stream_reads_alternates_which_scheme_reads_first(bench):
    """The new scheme always read first at every R (its MB/s on a machine whose load drifts): now R by R in turn."""
    bs = bench("bench_stream_reads")
    order = []
    for i in range(3):
        assert bs.both_schemes(i, lambda: order.append("new") or "N", lambda: order.append("old") or "O") == ("N", "O")
    assert order == ["new", "old", "old", "new", "new", "old"]

# gpu_compare: dsrecipes and TRL alike. Each test below fails on the harness before its rule: there a failed
# dsrecipes run kept a tokens/s, a failed TRL run was a 0-high bar in the plot, TRL's padding-free tokens were counted
# as those unlike the pad id, TRL was timed one step fewer, and a run out of memory at the chosen micro-batch was
# only a missing row.


def test_only_a_finished_run_counts_whichever_side_it_is(bench):
    ok = {"system": "trl_best", "exit": 0, "steps": 24, "tokens_per_s": 100.0, "mfu": 0.3}
    assert bench("_compare_rows").counted(ok, 24) == ok
    died = bench("_compare_rows").counted({"system": "dsrecipes", "exit": 1, "steps": 12, "tokens_per_s": 500.0}, 24)
    assert died["tokens_per_s"] is None and died["tokens_per_s_partial"] == 500.0 and died["not_counted"] == "exit 1"
    short = bench("_compare_rows").counted({"system": "dsrecipes", "exit": 0, "steps": 12, "tokens_per_s": 500.0}, 24)
    assert short["tokens_per_s"] is None and short["not_counted"] == "12 of 24 steps"
    timeout = bench("_compare_rows").counted({"system": "trl_plain", "exit": "timeout"}, 24)
    assert timeout["tokens_per_s"] is None and "tokens_per_s_partial" not in timeout


def test_dsrecipes_without_two_log_lines_has_no_rate(bench):
    """One metrics line is no measurement: the old harness took that window's own rate (its first steps)."""
    assert bench("gpu_compare").steady_tokens_per_s([{"step": 4, "tokens_per_s": 9e9, "elapsed": 1.0}], 8) == (None, None)


def test_trl_and_dsrecipes_are_timed_over_the_same_steps(bench):
    """A step k ends at time k with 100 k tokens seen (and a jump of 1e6 tokens at the first step after the untimed
    ones: any window that took in one more early step would show it). TRL's clock, dsrecipes' log windows and the
    bare loop time the same steps: 9..24 of 24 (TRL's were 10..24 before), and where steps // 3 is not a step with a
    dsrecipes log line (16 steps, a line every 2: 5), both start at the line before it (4)."""
    rows, trl, gc = bench("_compare_rows"), bench("_trl_sft"), bench("gpu_compare")
    for steps, first in ((24, 9), (16, 5), (10, 4)):
        after = rows.timed_after(steps)
        assert after + 1 == first, (steps, after)
        marks = [(float(k), 100.0 * k + (1e6 if k > after else 0)) for k in range(1, steps + 1)]
        timed = trl.timed_rate(marks, steps)
        assert timed["timed_steps"] == steps - after and timed["step_s"] == 1.0, (steps, timed)
        every = rows.log_every(steps)
        lines = [{"step": k, "tokens_per_s": 100.0, "elapsed": float(k)} for k in range(every, steps + 1, every)]
        lines += [] if steps % every == 0 else [{"step": steps, "tokens_per_s": 100.0, "elapsed": float(steps)}]
        assert gc.steady_tokens_per_s(lines, after)[0] == 100.0
        windows = [prev["step"] for prev, r in zip(lines, lines[1:]) if r["step"] > after]
        assert windows[0] == after, (steps, windows)


def test_trl_counts_its_padding_free_tokens_whatever_their_ids(bench):
    """TRL's padding-free batch has no attention mask; the HF Trainer's "non_padding" count then drops every token
    equal to the pad id, which TRL sets to eos where a tokenizer has none (a template writing eos at each turn's end
    loses a token a turn). The harness counts "all" there (nothing is padding) and "non_padding" for padded batches."""
    from transformers import Trainer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = [{"input_ids": [5, 0, 7]}, {"input_ids": [9, 0]}]  # 0: the pad id, = eos, inside the conversations
    real = 5

    def seen(mode: str, padding_free: bool) -> int:
        batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free)(rows)
        fake = types.SimpleNamespace(
            args=types.SimpleNamespace(include_num_input_tokens_seen=mode, device="cpu"), model=object(),
            processing_class=types.SimpleNamespace(pad_token_id=0), accelerator=types.SimpleNamespace(gather=lambda t: t),
            state=types.SimpleNamespace(num_input_tokens_seen=0))
        Trainer._track_num_input_tokens(fake, batch)
        return fake.state.num_input_tokens_seen

    assert seen("non_padding", True) == 3  # what the old harness counted for TRL best: 2 of its 5 tokens lost
    best, plain = (argparse.Namespace(mode=m) for m in ("best", "plain"))
    assert seen(bench("_trl_sft").token_count(best), True) == real
    assert seen(bench("_trl_sft").token_count(plain), False) == real


def test_a_run_out_of_memory_runs_again_at_half_the_micro_batch(bench, tmp_path):
    oom, other = tmp_path / "oom.log", tmp_path / "other.log"
    oom.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    other.write_text("ValueError: something else\n")
    tried, notes = [], []

    def run(mb, accum):
        tried.append((mb, accum))
        return ({"exit": 0, "micro_batch": mb, "grad_accum": accum} if mb == 2 else {"exit": 1}), [oom]

    row = bench("_compare_rows").with_oom_retries(run, 8, 1, time.time() + 60, notes.append, "1.5b ZeRO-2 trl_best")
    assert tried == [(8, 1), (4, 2), (2, 4)] and row["exit"] == 0 and row["oom_at"] == [8, 4]
    assert len(notes) == 2 and "the same tokens per optimizer step" in notes[0]
    tried.clear()
    row = bench("_compare_rows").with_oom_retries(lambda mb, acc: (tried.append(mb) or {"exit": 1}, [other]), 8, 1,
                                      time.time() + 60, notes.append, "x")
    assert tried == [8] and "oom_at" not in row  # another failure is not retried
    tried.clear()
    row = bench("_compare_rows").with_oom_retries(lambda mb, acc: (tried.append(mb) or {"exit": 1}, [oom]), 8, 1,
                                      time.time() - 1, notes.append, "x")
    assert tried == [8] and row["oom_at"] == [8] and "time budget spent" in notes[-1]


def test_a_failed_trl_run_is_shown_failed_not_absent_or_zero(bench, tmp_path):
    cell = {"model": "m", "zero": 2}
    rows = [{**cell, "system": "dsrecipes", "exit": 0, "steps": 24, "tokens_per_s": 100.0},
            bench("_compare_rows").counted({**cell, "system": "dsrecipes_levers", "exit": 1, "steps": 10, "tokens_per_s": 900.0},
                               24),
            bench("_compare_rows").counted({**cell, "system": "trl_best", "exit": 1, "oom_at": [8, 4, 2, 1]}, 24),
            {**cell, "system": "trl_best_flex", "exit": 0, "steps": 24, "tokens_per_s": 80.0},
            bench("_compare_rows").counted({**cell, "system": "trl_plain", "exit": "timeout"}, 24)]
    table = bench("_compare_rows").ratio_table(rows).splitlines()
    line = table[1].split()
    assert line[2:] == ["100", "-", "fail", "80", "fail", "-", "1.25", "-", "-"], line
    text = "\n".join(table)
    assert "trl_best not counted (exit 1, out of memory at micro-batch [8, 4, 2, 1])" in text
    assert "TRL best = trl_best_flex" in text and "dsrecipes_levers not counted (exit 1)" in text
    bench("_compare_rows").plot(rows, tmp_path / "p.png")  # a failed run: a labelled gap (no error on None)
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_table_says_when_trl_best_ran_without_flash_attention(bench):
    """Without flash-attn TRL best is not TRL's best (its packing path is flash-attention's): the ratio over it
    flatters dsrecipes, and the table says so under the cell; with flash-attention 2 it says nothing."""
    cell = {"model": "m", "zero": 2}
    rows = [{**cell, "system": "dsrecipes", "tokens_per_s": 100.0},
            {**cell, "system": "trl_best", "tokens_per_s": 50.0, "settings": {"attn_implementation": "sdpa"}}]
    table = bench("_compare_rows").ratio_table(rows)
    assert "TRL best ran on sdpa, not flash-attention 2" in table and table.splitlines()[1].split()[-3] == "2.00*"
    rows[1]["settings"]["attn_implementation"] = "flash_attention_2"
    table = bench("_compare_rows").ratio_table(rows)
    assert "notes:" not in table and table.splitlines()[1].split()[-3] == "2.00"


def test_trl_logs_as_often_as_dsrecipes(bench):
    """Each log line is a device sync on both sides: TRL logged every steps // 5, dsrecipes every steps // 6."""
    args = bench("_trl_sft").parse_args(["--model", "m", "--data", "d", "--result", "/tmp/r.json", "--mode", "best",
                                          *[w for n in ("--seq", "--micro-batch", "--grad-accum", "--workers")
                                            for w in (n, "1")], "--steps", "30",
                                          *[w for n in bench("_trl_sft").HF_FLOATS for w in (n, "0.1")]])
    gc = bench("gpu_compare")
    overrides = gc.ds_overrides(gc.parse_args(["--steps", "30"]), Path("m"), 2, "d", Path("r"))
    assert f"trainer.log_every={bench('_trl_sft').sft_settings(args, False)['logging_steps']}" in overrides


def test_bench_store_gives_streaming_the_shuffle_block_asked(bench, monkeypatch):
    """streaming's default shuffle is near-global, dsrecipes' local: --st-shuffle-block reaches StreamingDataset (and
    None leaves streaming's default), so a like-with-like run is one flag away."""
    st = bench("_store_streaming")
    seen = []
    monkeypatch.setitem(sys.modules, "streaming", types.SimpleNamespace(StreamingDataset=lambda **kw: seen.append(kw)))
    monkeypatch.setattr(st, "SHUFFLE_BLOCK", [1234])
    st.st_dataset(Path("/nonexistent"), 4)
    monkeypatch.setattr(st, "SHUFFLE_BLOCK", [None])
    st.st_dataset(Path("/nonexistent"), 4)
    assert [kw["shuffle_block_size"] for kw in seen] == [1234, None] and all(kw["shuffle"] for kw in seen)
