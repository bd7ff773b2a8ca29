"""Short runs and sweeps read right (issue 22 item 7): a run shorter than trainer.log_every has one logged loss and
its summary says so (not "7.16 -> 7.16"); a curve of one point is drawn as a marker (a line through one point
draws nothing); the sweep table marks the best job by the sweep's metric (eval loss, else final train loss)."""

from __future__ import annotations

import numpy as np

from dsrecipes.observe import sweep
from dsrecipes.observe.metrics import MetricsLogger
from dsrecipes.observe.plots import run_figure, sweep_figure
from dsrecipes.observe.report import closing_summary
from tests.test_sweep import fake_job


def _run(tmp_path, losses, evals=()):
    log = MetricsLogger(tmp_path, rank=0, total_steps=max(s for s, _ in losses), bar=False)
    for step, loss in losses:
        log.log_train(step=step, loss=loss, lr=1e-3, grad_norm=1.0, tokens_per_s=100.0, samples_seen=step,
                      elapsed=float(step))
    for step, loss in evals:
        log.log_eval(step, loss)
    log.close()
    return tmp_path


def test_a_run_shorter_than_log_every_summarizes_its_one_logged_loss(tmp_path):
    text = closing_summary(_run(tmp_path, [(3, 7.16)], [(3, 7.5)]), 4.0, [], 3)
    assert "  train loss   7.1600  (1 logged value, step 3)" in text.splitlines()
    assert "  eval loss    7.5000  (1 evaluation, step 3)" in text.splitlines()
    assert "->" not in text.split("run dir")[0]


def test_a_longer_run_gives_first_and_last_and_how_many(tmp_path):
    text = closing_summary(_run(tmp_path, [(10, 7.0), (20, 3.0), (30, 1.5)], [(30, 1.7)]), 4.0, [], 30)
    assert "  train loss   7.0000 -> 1.5000  (first and last of 3 logged values, steps 10-30)" in text.splitlines()


def test_a_resumed_run_says_how_many_steps_this_invocation_trained(tmp_path):
    """'done: 60 steps in 24s' after a resume at step 51 claimed 60 steps in 24 s."""
    from dsrecipes.core.runplan import ResumePlan, RunPlan, write_plan

    run = _run(tmp_path, [(10, 7.0), (60, 1.9)])
    assert closing_summary(run, 24.0, [], 60).startswith("done: 60 steps in 24s")  # no plan.json: from the start
    plan = RunPlan(world_size=1, num_nodes=1, data_kind="map", rows=100, steps_per_epoch=10, total_steps=60,
                   data_fingerprint="x", resume=ResumePlan("checkpoints/step_51", 51, 1, False))
    write_plan(run, plan)
    assert closing_summary(run, 24.0, [], 60).startswith("done: 60 steps (9 in this run, resumed at step 51) in 24s")


def _drawn_pixels(fig, colour) -> int:
    """Pixels of `colour` inside the axes but outside the legend (what the reader sees as data)."""
    from matplotlib.colors import to_rgb

    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[:, :, :3].astype(int)
    height = image.shape[0]
    ax = fig.axes[0]
    inside = np.zeros(image.shape[:2], dtype=bool)
    box = ax.get_window_extent()
    inside[height - int(box.y1):height - int(box.y0), int(box.x0):int(box.x1)] = True
    legend = ax.get_legend().get_window_extent()
    inside[height - int(legend.y1) - 2:height - int(legend.y0) + 2, int(legend.x0) - 2:int(legend.x1) + 2] = False
    target = np.array([round(c * 255) for c in to_rgb(colour)])
    close = np.abs(image - target).sum(axis=2) < 30
    return int((close & inside).sum())


def test_a_one_point_train_curve_is_drawn(tmp_path):
    import matplotlib.pyplot as plt

    fig = run_figure([{"step": 3, "loss": 7.16}], "short")
    assert _drawn_pixels(fig, "tab:blue") > 10
    plt.close(fig)
    fig = sweep_figure([("zero=stage1", [{"step": 3, "loss": 7.1}]), ("zero=stage2", [{"step": 3, "loss": 6.9}])])
    assert _drawn_pixels(fig, plt.get_cmap("tab10")(0)) > 10 and _drawn_pixels(fig, plt.get_cmap("tab10")(1)) > 10
    plt.close(fig)
    fig = run_figure([{"step": s, "loss": 7.0 - s} for s in (1, 2, 3)])  # a real line stays a line
    assert fig.axes[0].lines[0].get_marker() in ("None", None, "")
    plt.close(fig)


def test_the_sweep_table_marks_the_best_job_by_eval_loss(tmp_path):
    for num, (zero, final, evl) in enumerate((("stage1", 2.0, 2.9), ("stage2", 2.5, 2.4), ("stage3", 1.0, None))):
        metrics = [{"step": 3, "loss": final}] + ([{"step": 3, "eval_loss": evl}] if evl is not None else [])
        fake_job(tmp_path, num, [f"zero={zero}"], {"status": "ok", "error": None}, metrics)
    fake_job(tmp_path, 3, ["zero=stage0"], {"status": "failed", "error": "boom", "final_eval_loss": 0.1})
    md = sweep.render_markdown(sweep.collect(tmp_path)).splitlines()
    assert md[3].startswith("| 1 (best) | stage2 | ok | 2.5000 | **2.4000** |")  # lowest eval loss, not train loss
    assert sum("(best)" in line for line in md) == 1  # a failed job is never best
    assert md[-1] == "best by eval loss (lowest): job 1 (zero=stage2)"


def test_best_falls_back_to_train_loss_and_needs_two_jobs(tmp_path):
    fake_job(tmp_path, 0, ["x=1"], {"status": "ok", "error": None}, [{"step": 1, "loss": 3.0}])
    assert "(best)" not in sweep.render_markdown(sweep.collect(tmp_path))  # one job is not best of anything
    fake_job(tmp_path, 1, ["x=2"], {"status": "ok", "error": None}, [{"step": 1, "loss": 2.0}])
    md = sweep.render_markdown(sweep.collect(tmp_path)).splitlines()
    assert md[3].startswith("| 1 (best) | 2 | ok | **2.0000** |") and md[-1].startswith("best by final loss")
