"""Hostile review of today's changes (e52882f..): what failed on the code as it was.

mean_rate (core/metrics_file.py, 38c9153): a run started before metrics lines carried `tokens` and resumed after
has old lines without it and new ones with it; weighing the old by steps and the new by tokens added steps to
tokens (and step-weighted 'seconds' to real seconds). A metrics.jsonl handed over with a non-numeric `tokens` was a
TypeError traceback instead of a number or None.
"""

from __future__ import annotations

import json
import sys

import pytest

from dsrecipes.core.metrics_file import mean_rate
from dsrecipes.core.rundir import run_summary
from dsrecipes.observe.metrics import MetricsLogger
from dsrecipes.run.launch import process
from dsrecipes.run.launch.plan import Command


def test_a_resumed_runs_old_lines_without_tokens_do_not_mix_units():
    """Steps 1-20 logged before `tokens` (windows of 10 steps of 100 tokens each at 100 tokens/s: 10 s each), the
    resume's windows with `tokens`: 1000 tokens at 1000 tokens/s (1 s each). Windows 2-4: 3000 tokens in 12 s (the
    old code: 2010 'tokens' in 2.1 's', 957)."""
    old = [{"step": s, "loss": 1.0, "tokens_per_s": 100.0} for s in (10, 20)]
    new = [{"step": s, "loss": 1.0, "tokens_per_s": 1000.0, "tokens": 1000} for s in (30, 40)]
    assert mean_rate(old + new) == pytest.approx(3000 / 12)


@pytest.mark.parametrize("tokens", ["1000", None, [1], True, float("nan")])
def test_a_handed_over_line_with_a_bad_tokens_value_is_no_traceback(tmp_path, tokens):
    rows = [{"step": s, "loss": 1.0, "tokens_per_s": 100.0, "tokens": 1000} for s in (10, 20, 30)]
    rows[1]["tokens"] = tokens
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rate = run_summary(tmp_path)["tokens_per_s"]
    assert rate is None or rate == pytest.approx(100.0)


# A multi-node torchrun agent whose ranks have ended waits in its exit barrier for the other nodes' agents (torch's
# SimpleElasticAgent._exit_barrier, up to 300 s): node 1's agent, while node 0's rank 0 exports after the final
# barrier. Supervision took that for a hung launcher LAUNCHER_EXIT_S later and killed it, and `dsrecipes node`
# (join.conclude, 28c31a3) then ended 1 naming it, after a run that succeeded.
_AGENT_IN_ITS_EXIT_BARRIER = ("import subprocess, sys, time\n"
                              "subprocess.run([sys.executable, '-c', 'import time; time.sleep(1.5)'])\n"  # its rank, ended, reaped
                              "time.sleep(3)\n")  # the other nodes' agents: node 0's rank 0 still exports


def test_a_multi_node_torchrun_agent_waiting_for_the_other_nodes_is_not_killed_as_hung(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(process, "LAUNCHER_EXIT_S", 1.0)
    argv = [sys.executable, "-c", _AGENT_IN_ITS_EXIT_BARRIER, "-m", "torch.distributed.run", "--nnodes", "2"]
    code = process.run_subprocess(Command(argv), tmp_path, grace_s=10)
    assert code == 0 and process.launcher_hung(tmp_path) is None, capsys.readouterr().err
    assert "every rank has ended" not in capsys.readouterr().err


def test_a_one_node_launcher_left_after_its_ranks_is_still_ended(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(process, "LAUNCHER_EXIT_S", 1.0)
    argv = [sys.executable, "-c", _AGENT_IN_ITS_EXIT_BARRIER, "-m", "torch.distributed.run", "--nnodes", "1"]
    assert process.run_subprocess(Command(argv), tmp_path, grace_s=10) == -9
    assert process.launcher_hung(tmp_path) is not None


# A resume warms up again (the engine, the allocator, the first batches), but mean_rate left out only the file's first
# window: the resumed attempt's slow first window counted, with its whole time (38c9153 weighs windows by time).
def test_a_resumes_first_window_is_left_out_like_the_runs_first(tmp_path):
    log = MetricsLogger(tmp_path, rank=0, total_steps=40, bar=False)
    for step in (10, 20):  # the first attempt: a 10 s warm-up window, then 1000 tokens/s
        log.log_train(step=step, loss=1.0, lr=1e-3, grad_norm=None, tokens_per_s=100.0 if step == 10 else 1000.0,
                      samples_seen=step, elapsed=1.0, tokens=1000)
    log.close()
    log = MetricsLogger(tmp_path, rank=0, total_steps=40, start_step=20, bar=False)  # resumed from step 20
    for step in (30, 40):  # its own warm-up window, then 1000 tokens/s again
        log.log_train(step=step, loss=1.0, lr=1e-3, grad_norm=None, tokens_per_s=100.0 if step == 30 else 1000.0,
                      samples_seen=step, elapsed=1.0, tokens=1000)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("warmup", False) for r in rows] == [False, False, True, False]  # (the file's first needs no mark)
    assert run_summary(tmp_path)["tokens_per_s"] == pytest.approx(1000.0)  # was 3000 tokens in 12 s: 250


def test_only_warm_up_windows_still_give_a_rate():
    rows = [{"step": 5, "tokens_per_s": 50.0, "tokens": 100, "warmup": True}]
    assert mean_rate(rows) == pytest.approx(50.0)


# A sweep's launcher=local job runs its rank as the supervised child itself (run_in_process, `in_process`): its
# children are its own (DataLoader workers, a tool it ran), not ranks. Once one had ended, supervision took a rank
# working on without children for LAUNCHER_EXIT_S (its final save and export after the last epoch's workers ended)
# for a hung launcher and SIGKILLed it.
def test_a_sweeps_rank_whose_own_workers_ended_is_not_killed_as_a_hung_launcher(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(process, "LAUNCHER_EXIT_S", 1.0)
    argv = [sys.executable, "-c", _AGENT_IN_ITS_EXIT_BARRIER]  # a worker for 1.5 s, then 3 s of its own work
    code = process.run_subprocess(Command(argv, in_process=True), tmp_path, grace_s=10, announce=False)
    assert code == 0 and process.launcher_hung(tmp_path) is None, capsys.readouterr().err
