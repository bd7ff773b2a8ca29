"""Sweep summary: table from result.json + metrics.jsonl; failing jobs reported; a real Hydra multirun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from dsrecipes.observe import sweep
from tests.conftest import in_process_environ

REPO = Path(__file__).resolve().parents[1]


def fake_job(sweep_dir: Path, num: int, overrides, result=None, metrics=()):
    job = sweep_dir / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    if result is not None:
        (job / "result.json").write_text(json.dumps(result))
    if metrics:
        (job / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return job


def test_summary_table_and_json(tmp_path):
    metrics = [
        {"step": 1, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "samples_seen": 4, "elapsed": 1},
        {"step": 2, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "samples_seen": 8, "elapsed": 2},
        {"step": 2, "eval_loss": 2.7},
        {"step": 3, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 200.0, "samples_seen": 12, "elapsed": 3},
        '{"step": 4, "lo',  # cut short by a kill: ignored
    ]
    fake_job(tmp_path, 0, ["zero=stage1", "trainer.max_steps=3"], {"status": "ok", "error": None, "peak_mem_mb": 512.0},
             [m if isinstance(m, dict) else {} for m in metrics[:4]])  # fmt: skip
    (tmp_path / "0" / "metrics.jsonl").open("a").write(metrics[4])
    fake_job(tmp_path, 1, ["zero=stage2", "trainer.max_steps=3"],
             {"status": "failed", "error": "UserError: boom | bad", "final_loss": None})  # fmt: skip
    fake_job(tmp_path, 10, ["zero=stage3", "trainer.max_steps=3"])  # no result.json: still running or killed
    rows = sweep.write_summary(tmp_path)
    assert [r["job"] for r in rows] == ["0", "1", "10"]
    ok, failed, unknown = rows
    assert ok["status"] == "ok" and ok["final_loss"] == 2.0 and ok["final_eval_loss"] == 2.7
    # without the first (warm-up) line: the tokens of steps 2 and 3 over their time (equal tokens per step), not the
    # plain mean of the rates (150)
    assert ok["tokens_per_s"] == pytest.approx(2 / (1 / 100 + 1 / 200))
    assert ok["peak_mem_mb"] == 512.0
    assert failed["status"] == "failed" and "boom" in failed["error"]
    assert unknown["status"] == "unknown"
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["swept"] == ["zero"] and data["ok"] == 1 and data["failed"] == 1
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[0] == "| job | zero | status | final loss | eval loss | tokens/s | peak MB | error |"
    assert md[2].startswith("| 0 | stage1 | ok | 2.0000 | 2.7000 | 133.3 | 512 |")
    assert "boom \\| bad" in md[3]


def test_result_contract_keys():
    assert sweep.RESULT_KEYS == ("status", "error", "final_loss", "final_eval_loss", "tokens_per_s", "peak_mem_mb")


APP = """
import json, os
from pathlib import Path
import hydra
from hydra.core.hydra_config import HydraConfig

@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def job(cfg):
    out = Path(HydraConfig.get().runtime.output_dir)
    if cfg.x == 2:
        raise RuntimeError("job two exploded")
    if cfg.x == 3:
        (out / "result.json").write_text(json.dumps({"status": "failed", "error": "ranks exited with code 1"}))
        return
    rows = [{"step": s, "loss": 4.0 / s, "tokens_per_s": 50.0 * cfg.x} for s in (1, 2, 3)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
    (out / "result.json").write_text(json.dumps({"status": "ok", "error": None, "peak_mem_mb": 100.0}))

if __name__ == "__main__":
    job()
"""

CONF = """
x: 0
hydra:
  callbacks:
    sweep_summary:
      _target_: dsrecipes.observe.sweep.SweepSummary
"""


@pytest.mark.slow
def test_real_hydra_multirun_with_a_failing_job(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text(textwrap.dedent(CONF))
    (tmp_path / "app.py").write_text(APP)
    sweep_dir = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "app.py", "-m", "x=1,2,3,4", f"hydra.sweep.dir={sweep_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # Hydra's basic sweeper runs every job of the batch, then re-raises the failure (dsrecipes.run.entry never raises
    # in a sweep); the summary was already written by on_job_end.
    assert done.returncode == 1 and "job two exploded" in done.stderr
    data = json.loads((sweep_dir / "summary.json").read_text())
    status = {tuple(j["overrides"]): j["status"] for j in data["jobs"]}
    assert status == {("x=1",): "ok", ("x=2",): "failed", ("x=3",): "failed", ("x=4",): "ok"}
    two = next(j for j in data["jobs"] if j["overrides"] == ["x=2"])
    assert "job two exploded" in two["error"]  # the callback wrote result.json for the job that raised
    four = next(j for j in data["jobs"] if j["overrides"] == ["x=4"])
    assert four["final_loss"] == pytest.approx(4.0 / 3) and four["tokens_per_s"] == 200.0
    table = [line for line in (sweep_dir / "summary.md").read_text().splitlines() if line.startswith("|")]
    assert len(table) == 6  # header, rule, 4 jobs

    done = subprocess.run(
        [sys.executable, "app.py", "-m", "x=1,3", f"hydra.sweep.dir={tmp_path / 'sweep2'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| job | x | status |" in done.stdout  # on_multirun_end prints the table
    assert "| 1 | 3 | failed |" in done.stdout


def dsrecipes_in_process(*argv: str) -> int:
    """`python -m dsrecipes ARGV` as `dsrecipes.cli.main` in this process (the working directory is the caller's):
    its exit code; the environment is restored after (a run sets RANK, MASTER_PORT, ... for its rank)."""
    from dsrecipes.cli import main

    with in_process_environ():
        return main(list(argv))


@pytest.mark.slow
def test_dsrecipes_sweep_dry_run_writes_summary(tmp_path, monkeypatch, capsys):
    """The real entry (in this process): each job composes, prepares and "launches" (dry run); the summary lists every
    job."""
    monkeypatch.chdir(tmp_path)
    sweep_dir = tmp_path / "sweep"
    code = dsrecipes_in_process("-m", "launcher.dry_run=true", "zero=stage1,stage2", "trainer.max_steps=12",
                                f"hydra.sweep.dir={sweep_dir}")
    assert code == 0, capsys.readouterr().err[-3000:]
    data = json.loads((sweep_dir / "summary.json").read_text())
    assert data["swept"] == ["zero"] and [j["status"] for j in data["jobs"]] == ["dry_run", "dry_run"]
    assert all((Path(j["run_dir"]) / "launch.txt").is_file() for j in data["jobs"])
    assert (sweep_dir / "dsrecipes_sweep.json").is_file()  # ours: the same sweep may run into it again


def test_a_sweep_never_writes_into_a_foreign_directory(tmp_path, monkeypatch, capsys):
    """hydra.sweep.dir naming someone's directory is refused before Hydra writes anything (its .hydra/, the summary
    files); hydra.sweep.subdir, which could put a job's directory anywhere (`../victim`), is closed to overrides."""
    from tests.test_run_ownership import snapshot

    monkeypatch.chdir(tmp_path)
    victim = tmp_path / "victim"
    (victim / "0" / ".hydra").mkdir(parents=True)
    for rel in ("summary.md", "multirun.yaml", "0/result.json", "0/.hydra/config.yaml"):
        (victim / rel).write_text(f"{rel}: theirs\n")
    before = snapshot(victim)
    code = dsrecipes_in_process("-m", "launcher.dry_run=true", "zero=stage1,stage2", f"hydra.sweep.dir={victim}")
    err = capsys.readouterr().err
    assert code == 2 and f"hydra.sweep.dir: {victim} is not empty (0, multirun.yaml, summary.md)" in err, err
    code = dsrecipes_in_process("-m", "launcher.dry_run=true", "zero=stage1,stage2",
                                f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=../victim/0")
    err = capsys.readouterr().err
    assert code == 2 and "command-line override 'hydra.sweep.subdir=../victim/0'" in err, err
    assert snapshot(victim) == before and not (tmp_path / "sweep").exists() and not (tmp_path / "multirun").exists()


def test_explicit_output_dir_and_hydra_dir_are_both_searched(tmp_path):
    out = tmp_path / "explicit"
    out.mkdir()
    job = fake_job(tmp_path / "sweep", 0, ["trainer.max_steps=3"], {"status": "ok", "error": None})  # result: Hydra dir
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"trainer": {"output_dir": str(out)}}))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 1.5, "tokens_per_s": 9.0}) + "\n")
    (row,) = sweep.collect(tmp_path / "sweep")
    assert row["status"] == "ok" and row["final_loss"] == 1.5 and row["run_dir"] == str(out.resolve())


@pytest.mark.slow
def test_dsrecipes_sweep_really_trains_each_job_and_reports_a_failing_one(tmp_path, monkeypatch, capsys):
    """Three real jobs, in two sweeps run in this process: two train (ZeRO-0 and ZeRO-1), one is refused at run start
    (fp16 without CUDA)."""
    monkeypatch.chdir(tmp_path)
    sweep_dir = tmp_path / "sweep"
    code = dsrecipes_in_process("-m", "debug=fast", "trainer.export=false", "trainer.log_every=1",
                                "zero=stage0,stage1", f"data.cache_dir={tmp_path / 'cache'}",
                                f"hydra.sweep.dir={sweep_dir}")
    assert code == 0, capsys.readouterr().err[-3000:]
    code = dsrecipes_in_process("-m", "debug=fast", "trainer.export=false", "precision=fp16,fp32",
                                "trainer.max_steps=2", "scheduler.warmup_steps=0",
                                f"data.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={tmp_path / 'sweep2'}")
    assert code == 2, "a failed job makes the sweep exit non-zero after every job ran"

    jobs = json.loads((sweep_dir / "summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["ok", "ok"]
    for job in jobs:
        assert job["final_loss"] is not None and job["final_eval_loss"] is not None
        assert job["tokens_per_s"] and job["peak_mem_mb"] > 0
    table = (sweep_dir / "summary.md").read_text()
    assert table.splitlines()[0].startswith("| job | zero | status | final loss | eval loss | eval_accuracy | "
                                            "tokens/s | peak MB")  # SFT runs report their token accuracy

    second = json.loads((tmp_path / "sweep2" / "summary.json").read_text())["jobs"]
    assert [j["status"] for j in second] == ["failed", "ok"]
    assert "fp16 needs a CUDA GPU" in second[0]["error"] and second[1]["final_loss"] is not None


def test_summary_picture_has_every_job_labelled_by_its_swept_values(tmp_path):
    """summary.png: each job's train and eval curves on one set of axes; a job without metrics is left out."""
    import matplotlib.image

    for num, lr in enumerate(("1e-3", "3e-3", "1e-2")):
        scale = (num + 1) / 3
        rows = [{"step": s, "loss": 7.0 / (1 + scale * s / 10), "tokens_per_s": 100.0} for s in range(10, 410, 10)]
        rows += [{"step": s, "eval_loss": 6.0 / (1 + scale * s / 12)} for s in (100, 200, 300, 400)]
        fake_job(tmp_path, num, [f"optimizer.lr={lr}", "trainer.max_steps=400"], {"status": "ok", "error": None}, rows)
    fake_job(tmp_path, 3, ["optimizer.lr=1", "trainer.max_steps=400"], {"status": "failed", "error": "NaN loss"})
    sweep.write_summary(tmp_path)
    png = tmp_path / "summary.png"
    assert png.is_file() and matplotlib.image.imread(png).shape[1] >= 900
    assert "![every job's train and eval loss](summary.png)" in (tmp_path / "summary.md").read_text()
    labels = sweep.curve_labels(sweep.collect(tmp_path))
    assert labels == ["optimizer.lr=1e-3", "optimizer.lr=3e-3", "optimizer.lr=1e-2", "optimizer.lr=1"]


def test_log_scale_when_losses_span_more_than_3x():
    from dsrecipes.observe.plots import use_log_scale

    assert use_log_scale([7.4, 2.0, 0.75]) and not use_log_scale([1.2, 0.9, 0.7]) and not use_log_scale([1.0, 0.0])
