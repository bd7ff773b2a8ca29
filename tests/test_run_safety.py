"""Resume, checkpoints, export and failures that never lose or mix work (tracker issue 10), on real 1-rank runs.

One base run (the tiny model, 8 steps, checkpoints at 4 and 8, its own copy of the data) is shared; every case
works on the base run itself when it only reads or is refused (and then proves the directory unchanged byte for
byte), or on a copy of it.
  contract    each setting a checkpoint cannot continue under (model, LoRA, optimizer, template, cutoff, packing,
              seed, data of the same size): exit 2 listing old -> new, nothing written; accepted changes reported in
              one line and the run continues; resume=never / another run's checkpoint into a run: refused
  damage      each kind of checkpoint file damaged: resume=auto names it and falls back to step 4 (for real once,
              with the base run's losses); an explicit resume_from to it: exit 2
  export      --out foreign / `.` / a file / an export with a user's file: refused byte for byte; empty: written;
              an earlier export: replaced, nothing left beside it
  nan         stop: exit 1, failed at the step, no checkpoint or export of its weights, strict result.json; skip:
              one poisoned step dropped and counted; non-finite steps in a row end the run
  two runs    started at once into one directory: one trains, the other is refused naming the holder
  lora        the checkpoint holds adapter + optimizer state only; it resumes to the same losses
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest

from tests.conftest import in_process_environ, subprocess_env
from tests.test_run_ownership import snapshot

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
SHORT = ["debug=fast", "trainer.log_every=1", "dataset.max_samples=240", "data.cutoff_len=96"]


@pytest.fixture(scope="session")
def ws(tmp_path_factory) -> Path:
    """One workspace per test process, shared with test_hostile_checkpoint, test_point_of_use_runs and test_disk_full
    (their runs have names of their own), so that the base run below is trained once, not once per module."""
    ws = tmp_path_factory.mktemp("safety")
    (ws / "data").mkdir()
    shutil.copyfile(SAMPLE, ws / "data" / "train.jsonl")
    return ws


def base_args(ws: Path, run: Path, *overrides: str) -> list:
    return [*SHORT, f"dataset.paths=[{ws / 'data' / 'train.jsonl'}]", f"data.cache_dir={ws / 'cache'}",
            f"trainer.output_dir={run}", *overrides]


def train(ws: Path, run: Path, *overrides: str, env: Dict[str, str] | None = None) -> Tuple[int, str]:
    """`python -m dsrecipes` with launcher=local, in this process: (exit code, output)."""
    from dsrecipes.cli import main

    out = io.StringIO()
    with in_process_environ(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        os.environ.update(env or {})
        code = main(base_args(ws, run, *overrides))
    return code, out.getvalue()


def losses(run: Path) -> Dict[int, float]:
    from dsrecipes.core.rundir import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


@pytest.fixture(scope="session")
def base(ws) -> Path:
    """The base run (8 steps, checkpoints at 4 and 8, an export), shared by every module that imports it: cases only
    read it or are refused (and prove it unchanged byte for byte), or work on a copy (copy_run)."""
    run = ws / "base"
    code, out = train(ws, run)
    assert code == 0, out[-3000:]
    assert sorted(losses(run)) == list(range(1, 9))
    return run


def refused(ws: Path, run: Path, *overrides: str, message: str) -> str:
    """Run, expect exit 2 with `message`, and prove `run` unchanged byte for byte."""
    before = snapshot(run)
    code, out = train(ws, run, *overrides)
    assert code == 2 and message in out and "Traceback" not in out, out[-3000:]
    assert snapshot(run) == before
    return out


# ---------------------------------------------------------------------------------------------------------------
# The resume contract


CHANGES = [
    ("model.lora.enabled=true", "model.lora.enabled: false -> true"),
    ("model.tiny.hidden_size=64", "model.tiny.hidden_size: 128 -> 64"),
    ("optimizer.name=sgd", 'optimizer.name: "adamw" -> "sgd"'),
    ("template=vicuna", 'template.name: "chatml" -> "vicuna"'),
    ("data.cutoff_len=64", "data.cutoff_len: 96 -> 64"),
    ("data.packing=true", "data.packing: false -> true"),
    ("trainer.seed=7", "trainer.seed: 42 -> 7"),
]


@pytest.mark.parametrize("override,line", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_resume_under_changed_settings_is_refused_before_anything_is_written(ws, base, override, line):
    out = refused(ws, base, override, message=f"cannot resume {base}/checkpoints/step_8")
    assert f"  {line}\n" in out


def test_the_same_number_of_different_rows_is_refused(ws, base):
    data = ws / "data" / "train.jsonl"
    original = data.read_bytes()
    rows = original.decode().splitlines(keepends=True)
    first = json.loads(rows[0])
    first["conversations"][-1]["value"] += " (edited)"
    data.write_text(json.dumps(first) + "\n" + "".join(rows[1:]))
    try:
        out = refused(ws, base, message="training data: fingerprint")
    finally:
        data.write_bytes(original)
    assert f"{data} changed" in out


def test_accepted_changes_are_reported_in_one_line_and_the_run_continues(ws, base):
    run = copy_run(base, ws / "longer")
    code, out = train(ws, run, "trainer.max_steps=10", "trainer.save_every=5", "data.num_workers=1")
    assert code == 0, out[-3000:]
    reports = [ln for ln in out.splitlines() if ln.startswith("resuming")]
    assert reports == [f"resuming {run}/checkpoints/step_8 with changed settings: data.num_workers: 0 -> 1, "
                       "trainer.max_steps: 8 -> 10, trainer.save_every: 4 -> 5"]
    assert sorted(losses(run)) == list(range(1, 11))


def test_resume_never_into_a_run_is_refused(ws, base):
    refused(ws, base, "trainer.resume=never", message="trainer.resume=never: ")


def test_another_runs_checkpoint_into_a_run_is_refused(ws, base):
    other = copy_run(base, ws / "other")
    refused(ws, base, f"trainer.resume_from={other}/checkpoints/step_4", message="belongs to another run")


# ---------------------------------------------------------------------------------------------------------------
# Damaged checkpoints


def damage(tag: Path, kind: str) -> str:
    """Damage one file of checkpoint `tag` the way it happens (a cut copy, a disk that filled up); returns its name."""
    files = {"weights": "mp_rank_00_model_states.pt", "rng": "rng/rank0.pt", "data_state": "data_state/rank0.json",
             "config": "config.yaml", "record": "complete.json"}
    path = tag / files.get(kind, "data_state/rank0.json")
    if kind == "data_state_same_size":  # valid size, broken JSON: only the hash can tell
        path.write_bytes(b"{" * path.stat().st_size)
    elif kind == "missing":
        path = tag / "rng" / "rank0.pt"
        path.unlink()
    elif kind == "record":
        path.write_text("")
    else:
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size // 2)
    return path.relative_to(tag).as_posix()


KINDS = ["weights", "rng", "data_state", "data_state_same_size", "config", "missing", "record"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_checkpoint_is_named_and_the_previous_one_is_used(ws, base, kind):
    from dsrecipes.core.runplan import read_plan

    run = copy_run(base, ws / f"damaged_{kind}")
    name = damage(run / "checkpoints" / "step_8", kind)
    code, out = train(ws, run, "launcher.dry_run=true")
    assert code == 0, out[-3000:]
    assert f"checkpoint {run}/checkpoints/step_8 is damaged ({name}" in out
    assert read_plan(run).resume.checkpoint == str(run / "checkpoints" / "step_4")
    code, out = train(ws, run, f"trainer.resume_from={run}/checkpoints/step_8", "launcher.dry_run=true")
    assert code == 2 and f"is not a complete checkpoint that verifies: {name}" in out


def test_a_run_falls_back_past_a_damaged_checkpoint_and_trains_the_same_steps(ws, base):
    from dsrecipes.boundary.checkpoint_find import damage as check

    run = copy_run(base, ws / "fallback")
    damage(run / "checkpoints" / "step_8", "weights")
    code, out = train(ws, run)
    assert code == 0 and f"resumed from {run}/checkpoints/step_4" in out, out[-3000:]
    assert check(run / "checkpoints" / "step_8") is None  # re-saved whole: swapped in, never half old, half new
    assert losses(run) == losses(base)


# ---------------------------------------------------------------------------------------------------------------
# Export


def export(run: Path, out: Path, cwd: Path) -> Tuple[int, str]:
    from tests.test_run_ownership import dsrecipes

    return dsrecipes("export", str(run), "--out", str(out), cwd=cwd)


def test_export_refuses_what_it_did_not_write_and_replaces_only_its_own(ws, base, tmp_path):
    from tests.test_run_ownership import foreign_dir

    theirs = foreign_dir(tmp_path / "theirs")
    afile = tmp_path / "model.bin"
    afile.write_bytes(b"x")
    for out in (theirs, Path("."), afile, afile / "sub"):
        before = snapshot(tmp_path)
        code, text = export(base, out, cwd=theirs if out == Path(".") else tmp_path)
        assert code == 2 and "Traceback" not in text and "error: --out:" in text, text[-2000:]
        assert snapshot(tmp_path) == before

    empty = tmp_path / "empty"
    empty.mkdir()
    assert export(base, empty, tmp_path)[0] == 0 and (empty / "model.safetensors").is_file()
    first = (empty / "model.safetensors").read_bytes()
    (empty / "model.safetensors").write_bytes(b"stale")  # an earlier export of ours, replaced whole
    assert export(base, empty, tmp_path)[0] == 0 and (empty / "model.safetensors").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "model.bin", "theirs"]  # nothing left beside

    (empty / "README.md").write_text("my notes on this model")  # now it holds a user's file
    before = snapshot(tmp_path)
    code, text = export(base, empty, tmp_path)
    assert code == 2 and "README.md" in text and snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------------------------
# Non-finite losses


def strict_json(path: Path) -> dict:
    def refuse(token):
        raise AssertionError(f"{path}: non-standard JSON constant {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_nan_loss_fails_the_run_without_saving_or_exporting_its_weights(ws):
    run = ws / "nan_stop"
    code, out = train(ws, run, "optimizer.lr=1e5")
    assert code == 1, out[-3000:]
    result = strict_json(run / "result.json")
    finite = [step for step, loss in losses(run).items() if loss is not None]
    assert result["status"] == "failed" and "non-finite" in result["error"]
    assert result["failed_step"] == max(finite) + 1 >= 2  # the first step whose loss was not finite
    assert not (run / "checkpoints").exists() and not (run / "export").exists()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda t: pytest.fail(f"metrics.jsonl holds {t}"))


def test_a_failed_run_is_failed_in_its_tracker(ws, monkeypatch):
    """Trackers (issue 16) hear how the run ended: a non-finite loss closes the MLflow run as FAILED."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    uri = f"file:{ws / 'mlruns'}"
    code, out = train(ws, ws / "nan_tracked", "optimizer.lr=1e5", "trainer.report_to=[mlflow]",
                      f"trainer.tracking_uri={uri}", "trainer.experiment=nan")
    assert code == 1, out[-3000:]
    client = MlflowClient(uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("nan").experiment_id])
    assert mlrun.info.status == "FAILED"


def test_skip_drops_a_poisoned_step_and_counts_it(ws):
    from tests.faults import injected

    run = ws / "nan_skip"
    with injected(nan_at_step=3):  # rank 0 runs in this process (launcher=local)
        code, out = train(ws, run, "trainer.nan_policy=skip")
    assert code == 0, out[-3000:]
    result = strict_json(run / "result.json")
    assert result["status"] == "ok" and result["skipped_steps"] == 1
    assert sorted(losses(run)) == [1, 2, 4, 5, 6, 7, 8]  # step 3 trained nothing and logged nothing
    assert "step 3: non-finite loss, step skipped" in out


def test_skip_gives_up_after_nan_max_skips_in_a_row(ws):
    run = ws / "nan_skip_many"
    code, out = train(ws, run, "optimizer.lr=1e5", "trainer.nan_policy=skip", "trainer.nan_max_skips=2",
                      "trainer.eval_every=0", "trainer.save_every=0", "dataset.val_size=0")
    assert code == 1
    result = strict_json(run / "result.json")
    assert result["status"] == "failed" and "2 steps in a row" in result["error"] and result["skipped_steps"] == 2
    assert not (run / "checkpoints").exists() and not (run / "export").exists()


# ---------------------------------------------------------------------------------------------------------------
# Two runs at once, LoRA checkpoints


def test_two_runs_started_at_once_into_one_directory(ws, base):
    run = ws / "twice"
    argv = [sys.executable, "-m", "dsrecipes", *base_args(ws, run)]
    procs = [subprocess.Popen(argv, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    loser = outs[[p.returncode for p in procs].index(2)]
    winner_pid = procs[[p.returncode for p in procs].index(0)].pid
    assert f"is in use by another run: pid {winner_pid}" in loser
    assert [ln for ln in loser.splitlines() if ln.startswith("error")] and "Traceback" not in loser
    assert losses(run) == losses(base)  # one clean run: nothing spliced into metrics.jsonl


def test_lora_checkpoints_hold_only_what_trains_and_resume_exactly(ws, base):
    import torch

    run = ws / "lora"
    assert train(ws, run, "model.lora.enabled=true", "optimizer.lr=1e-2")[0] == 0
    states = torch.load(run / "checkpoints" / "step_8" / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["module"] and all("lora_" in k for k in states["module"] if k.endswith(".weight"))
    size = lambda tag: sum(f.stat().st_size for f in tag.rglob("*") if f.is_file())  # noqa: E731
    lora, full = size(run / "checkpoints" / "step_8"), size(base / "checkpoints" / "step_8")
    print(f"\ncheckpoint of the tiny model: full {full:,} bytes, LoRA {lora:,} bytes")
    assert lora < full / 3

    resumed = ws / "lora_resumed"
    code, out = train(ws, resumed, "model.lora.enabled=true", "optimizer.lr=1e-2",
                      f"trainer.resume_from={run}/checkpoints/step_4")
    assert code == 0, out[-3000:]
    assert losses(resumed) == {s: v for s, v in losses(run).items() if s > 4}


# ---------------------------------------------------------------------------------------------------------------
# A requeued SLURM job (launcher=slurm's batch script, minus SLURM)


def in_process(main, argv: list, env: Dict[str, str]) -> Tuple[int, str, str]:
    """`python -m MODULE argv` as its `main(argv)` in this process, under exactly `env`: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with in_process_environ(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_a_requeued_batch_job_replans_and_resumes_by_itself(ws, base):
    """The generated launch.sbatch of a requeued job runs `python -m dsrecipes.run.requeue`, then its ranks: here both
    run as the batch script would (their `main` with its arguments and the rank's environment, in this process),
    on a run stopped after step 4 whose plan.json still says "from the start"."""
    import yaml

    from dsrecipes.core.rundir import CHECKPOINTS_DIR
    from dsrecipes.rank import worker
    from dsrecipes.run import requeue
    from dsrecipes.run.launch.slurm import sbatch_script

    run = copy_run(base, ws / "requeued")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["launcher"].update(kind="slurm", num_nodes=1, num_gpus=1)  # the job's ranks run unsupervised
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.rmtree(run / CHECKPOINTS_DIR / "step_8")
    (run / CHECKPOINTS_DIR / "latest").write_text("step_4")
    assert json.loads((run / "plan.json").read_text())["resume"] is None  # planned when it started

    env = subprocess_env({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    code, _, stderr = in_process(worker.main, ["--run-dir", str(run)], env)
    assert code == 2 and "plan.json" in stderr and "Traceback" not in stderr, stderr
    code, stdout, stderr = in_process(requeue.main, ["--run-dir", str(run)], env)
    assert code == 0 and "resuming from step 4" in stdout, stderr[-3000:]
    code, _, stderr = in_process(worker.main, ["--run-dir", str(run)], env)
    assert code == 0, stderr[-3000:]
    assert losses(run) == losses(base)

    from dsrecipes.config.load import load_run_config

    script = sbatch_script(load_run_config(run), run, 29500)
    assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:USR1@180" in script
    assert f"-m dsrecipes.run.requeue --run-dir {run}" in script and "scontrol requeue" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
