"""The LR schedule: no optimizer step at lr 0, warmup 0 at the peak, a warmup longer than the run clamped, and the
logged lr of every step equal to the closed form, across a resume with a larger step budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dsrecipes.core.schema import SchedulerConfig, SchedulerKind
from dsrecipes.rank.schedule import StepScheduler, lr_factor, warmup_steps


def expected_lr(step: int, total: int, warmup: int, kind: str, peak: float, floor: float = 0.0) -> float:
    """Written apart from dsrecipes.rank.schedule: ramp s/W from step 1, then decay over steps W+1..T, never reaching 0."""
    warmup = min(warmup, total)
    if step <= warmup:
        return peak * step / warmup
    progress = (step - 1 - warmup) / (total - warmup)
    shape = {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[kind]
    return peak * (floor + (1.0 - floor) * shape) if kind != "constant" else peak


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup,total", [(0, 1), (0, 7), (3, 10), (10, 3), (5, 5), (1, 2)])
def test_closed_form_and_no_step_at_zero(kind, warmup, total):
    cfg = SchedulerConfig(name=SchedulerKind(kind), warmup_steps=warmup, min_lr_ratio=0.0)
    factors = [lr_factor(cfg, s, total) for s in range(1, total + 1)]
    assert factors == pytest.approx([expected_lr(s, total, warmup, kind, 1.0) for s in range(1, total + 1)])
    assert all(f > 0 for f in factors)  # no wasted step, first or last
    if warmup == 0:
        assert factors[0] == 1.0  # starts at the peak
    else:
        assert factors[0] == pytest.approx(1 / min(warmup, total))


def test_warmup_longer_than_the_run_is_clamped_with_a_note():
    cfg = SchedulerConfig(warmup_steps=10)
    assert warmup_steps(cfg, 3) == (3, "note: scheduler.warmup_steps=10 is longer than the run's 3 optimizer steps; "
                                       "warming up over all 3")
    assert warmup_steps(cfg, 10) == (10, None)


def test_scheduler_object_sets_each_steps_lr_and_resumes_on_a_new_budget():
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW(params, lr=1.0)
    cfg = SchedulerConfig(name=SchedulerKind.cosine, warmup_steps=2, min_lr_ratio=0.1)
    sched = StepScheduler(opt, cfg, peak_lr=0.5, total_steps=6)
    seen = []
    for step in range(1, 7):
        seen.append(opt.param_groups[0]["lr"])  # what this optimizer step trains at
        opt.step()
        sched.step()
    assert seen == pytest.approx([expected_lr(s, 6, 2, "cosine", 0.5, 0.1) for s in range(1, 7)])
    state = sched.state_dict()
    opt.param_groups[0]["lr"] = 123.0  # what a restored optimizer state would put back
    longer = StepScheduler(opt, cfg, peak_lr=0.5, total_steps=20)
    longer.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == pytest.approx(expected_lr(7, 20, 2, "cosine", 0.5, 0.1))


# ---------------------------------------------------------------------------------------------------------------
# Real runs (local launcher, in this process): the lr in metrics.jsonl, step by step


def logged_lrs(run_dir: Path):
    from dsrecipes.observe.metrics import read_metrics

    return {r["step"]: r["lr"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_tiny_step_budgets_run_and_log_the_closed_form(tmp_path, steps, capsys):
    from tests.test_train_runs import train_run

    run, _ = train_run(tmp_path, f"s{steps}", f"trainer.max_steps={steps}", "scheduler.warmup_steps=10",
                       "trainer.export=false", world_size=1)
    assert logged_lrs(run) == pytest.approx({s: expected_lr(s, steps, 10, "cosine", 3e-3) for s in range(1, steps + 1)})
    assert f"scheduler.warmup_steps=10 is longer than the run's {steps} optimizer steps" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_with_a_larger_budget_applies_the_new_schedule_from_the_first_resumed_step(tmp_path):
    from tests.test_train_runs import train_run

    common = ["zero=stage2", "scheduler=linear", "scheduler.warmup_steps=2", "scheduler.min_lr_ratio=0.1", "trainer.export=false",
              "trainer.save_every=3"]
    first, _ = train_run(tmp_path, "first", "trainer.max_steps=6", *common, world_size=1)
    want_first = {s: expected_lr(s, 6, 2, "linear", 3e-3, 0.1) for s in range(1, 7)}
    assert logged_lrs(first) == pytest.approx(want_first)
    # from the middle checkpoint (step 3) into a new directory with another budget: steps 4..9 on a 9-step schedule
    resumed, _ = train_run(tmp_path, "from3", "trainer.max_steps=9", *common,
                           f"trainer.resume_from={first / 'checkpoints' / 'step_3'}", world_size=1)
    assert logged_lrs(resumed) == pytest.approx({s: expected_lr(s, 9, 2, "linear", 3e-3, 0.1) for s in range(4, 10)})
    # the same run directory, a larger budget: steps 7..12 on the 12-step schedule
    train_run(tmp_path, "first", "trainer.max_steps=12", *common, world_size=1)
    want = {**want_first, **{s: expected_lr(s, 12, 2, "linear", 3e-3, 0.1) for s in range(7, 13)}}
    assert logged_lrs(first) == pytest.approx(want)
