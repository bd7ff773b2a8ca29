"""What a preference run shows (issue 49 item 3): reward accuracy and margin in the step lines, the evaluation lines,
the closing summary and loss.png (driven by the metric names the objective reports, observe/headline.py), the loss
axis labelled per objective, the precomputed reference pass announced with bounded progress, and a line saying where
the learning rate came from when optimizer.lr is unset."""

from __future__ import annotations

import json

import pytest

from dsrecipes.core.choices import ObjectiveKind
from dsrecipes.observe import headline
from dsrecipes.observe.metrics import MetricsLogger, describe_eval
from dsrecipes.observe.plots import run_figure
from tests.conftest import in_process_environ

DPO_ROWS = [{"step": 1, "loss": 0.6931, "reward_accuracy": 0.5, "reward_margin": 0.0},
            {"step": 2, "loss": 0.60, "reward_accuracy": 0.75, "reward_margin": 0.12},
            {"step": 2, "eval_loss": 0.65, "eval_reward_accuracy": 0.625, "eval_reward_margin": 0.05}]


def test_every_objective_says_what_its_loss_is():
    assert set(headline.LOSS_UNITS) == set(ObjectiveKind)
    assert headline.loss_unit("dpo") == "mean per preference pair" and headline.loss_unit(None) == ""


def test_step_and_eval_lines_show_reward_accuracy_and_margin(tmp_path, capsys):
    from dsrecipes.core.schema import TrainConfig, TrainerConfig

    no_trackers = TrainConfig(trainer=TrainerConfig(report_to=[]))
    logger = MetricsLogger(tmp_path, 0, total_steps=2, bar=False, cfg=no_trackers)
    logger.log_train(1, 0.6931, 1e-5, None, 100.0, 4, 1.0, extra={"reward_accuracy": 0.625, "reward_margin": 0.0312,
                                                                  "rewards_chosen": 0.1})
    logger.log_train(2, 0.6931, 1e-5, None, 100.0, 4, 1.0)  # SFT: no extra, nothing more on the line
    logger.close()
    line, sft_line = capsys.readouterr().out.splitlines()
    assert "loss 0.6931  reward_acc 62.5%  margin 0.0312  lr" in line, line
    assert "reward_acc" not in sft_line and "rewards_chosen" not in line
    said = describe_eval({"eval_loss": 0.68, "eval_reward_accuracy": 0.75, "eval_reward_margin": -0.01})
    assert said == "eval_loss 0.6800  reward_acc 75.0%  margin -0.0100", said


def test_loss_png_labels_the_loss_per_objective_and_plots_the_rewards():
    fig = run_figure(DPO_ROWS, unit=headline.loss_unit(ObjectiveKind.dpo))
    axes = fig.get_axes()
    assert axes[0].get_ylabel() == "loss (mean per preference pair)"
    assert [a.get_ylabel() for a in axes[1:]] == ["reward acc", "margin"]
    assert [line.get_label() for line in axes[1].get_lines()] == ["train reward_acc", "eval reward_acc"]
    sft = run_figure([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}], unit=headline.loss_unit("sft"))
    assert [a.get_ylabel() for a in sft.get_axes()] == ["loss (mean per predicted token)"]


def test_the_learning_rate_rule_is_announced():
    from dsrecipes.config.defaults import lr_note
    from dsrecipes.config.load import compose_and_load

    cfg = compose_and_load(["model.path=/models/sft_export", "objective=dpo"], check_files=False)
    note = lr_note(cfg)
    assert note == ("learning rate: 2e-06 from model.finetune_lr x objective.lr_scale (sft_export's full fine-tuning "
                    "rate 2e-05 x 0.1 for dpo; optimizer.lr is unset); optimizer.lr=VALUE sets another"), note
    assert lr_note(compose_and_load(["optimizer.lr=1e-6"], check_files=False)) is None


@pytest.fixture(scope="module")
def dpo_console(tmp_path_factory):
    """A tiny DPO run (4 steps, evaluation at 2 and 4), its console (stdout + stderr) and its run directory."""
    import contextlib
    import io

    import dsrecipes.objectives.dpo_reference as dpo_reference
    from dsrecipes.cli import main

    ws = tmp_path_factory.mktemp("dpo_console")
    out, err = io.StringIO(), io.StringIO()
    saved, dpo_reference.PROGRESS_EVERY_S = dpo_reference.PROGRESS_EVERY_S, 0.0  # a progress line per batch
    try:
        with in_process_environ(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            import os

            os.environ["DSRECIPES_PROGRESS"] = "lines"
            code = main(["objective=dpo", "dataset=sample_pairs", "dataset.max_samples=20", "dataset.val_size=4",
                         "data.cutoff_len=128", "trainer.micro_batch_size=4", "trainer.max_steps=4",
                         "trainer.log_every=1", "trainer.eval_every=2", "trainer.export=false",
                         f"data.cache_dir={ws / 'cache'}", f"trainer.output_dir={ws / 'run'}",
                         f"hydra.run.dir={ws / 'run'}", "trainer.report_to=[]"])
    finally:
        dpo_reference.PROGRESS_EVERY_S = saved
    assert code == 0, err.getvalue()[-3000:]
    return out.getvalue() + err.getvalue(), ws / "run"


def test_a_dpo_run_shows_its_rewards_announces_its_reference_pass_and_its_learning_rate(dpo_console):
    console, run_dir = dpo_console
    steps = [line for line in console.splitlines() if line.startswith("step ") and " loss " in line]
    assert len(steps) == 4 and all("reward_acc " in s and "margin " in s for s in steps), console
    evals = [line for line in console.splitlines() if "eval_loss" in line]
    assert evals and all("reward_acc " in e and "margin " in e for e in evals), console
    assert "  train reward_acc" in console and "  eval reward_acc" in console and "  train margin" in console
    # one announcement for the 16 train and 4 validation pairs together: the reference model loads once
    assert console.count("under the reference model") == 1, console
    assert "reference pass: log-probs of 20 pairs under the reference model" in console, console
    assert "reference pass: 4/20 pairs (20%)" in console and "reference pass: 20 pairs in" in console, console
    assert "learning rate: 0.003 from model.tiny.finetune_lr" in console, console
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert run_figure(history, unit="x").get_axes()[1].get_ylabel() == "reward acc"
    assert (run_dir / "loss.png").is_file()
