"""metrics.py without a process group: sinks on rank 0 only, resume truncation, the loss plot."""

from __future__ import annotations

import json

import torch

from dsrecipes.core.rundir import read_metrics
from dsrecipes.observe.metrics import MetricsLogger
from dsrecipes.rank.step_window import Window


def test_rank0_writes_jsonl_tensorboard_and_plot(tmp_path):
    log = MetricsLogger(tmp_path, rank=0, total_steps=4, bar=False)
    for step in (1, 2, 3, 4):
        log.step()
        log.log_train(step=step, loss=5.0 - step, lr=1e-3, grad_norm=1.5, tokens_per_s=100.0, samples_seen=8 * step,
                      elapsed=float(step))
    log.log_eval(4, 1.25)
    log.close()
    lines = read_metrics(tmp_path)
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 4]
    assert set(lines[0]) == {"step", "loss", "lr", "grad_norm", "tokens_per_s", "samples_seen", "elapsed"}
    assert lines[-1] == {"step": 4, "eval_loss": 1.25}
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_other_ranks_write_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "run", rank=1, total_steps=2)
    log.log_train(step=1, loss=1.0, lr=1.0, grad_norm=None, tokens_per_s=1.0, samples_seen=1, elapsed=1.0)
    log.log_eval(1, 1.0)
    log.close()
    assert not (tmp_path / "run").exists()


def test_resume_drops_lines_past_the_checkpoint(tmp_path):
    rows = [{"step": s, "loss": float(s)} for s in range(1, 7)] + [{"step": 4, "eval_loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = MetricsLogger(tmp_path, rank=0, total_steps=6, start_step=4, bar=False)
    log.log_train(step=5, loss=9.0, lr=0.1, grad_norm=None, tokens_per_s=1.0, samples_seen=1, elapsed=1.0)
    log.close()
    steps = [(r["step"], "eval_loss" in r) for r in read_metrics(tmp_path)]
    assert steps == [(1, False), (2, False), (3, False), (4, False), (4, True), (5, False)]


def test_window_averages_micro_batches_and_counts_tokens():
    window = Window()
    window.reset()
    window.add(torch.tensor(2.0), {"num_tokens": 10, "ids": ["a", "b"]})
    window.add(torch.tensor(4.0), {"num_tokens": 6, "ids": ["c"]})
    totals = window.reduce()  # no process group: this rank's numbers
    assert totals["loss"] == 3.0 and totals["tokens"] == 16 and totals["samples"] == 3 and totals["seconds"] > 0
