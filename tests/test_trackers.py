"""Experiment trackers: MLflow for real on a local file store, W&B in offline mode, a missing extra is one message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.observe import trackers
from dsrecipes.observe.metrics import MetricsLogger
from tests.conftest import subprocess_env


def _cfg(make_cfg, *overrides):
    return make_cfg(*overrides, check_files=False)


def test_report_to_is_a_typed_list(make_cfg):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.errors import ConfigError
    from dsrecipes.core.schema import ReportTo

    assert _cfg(make_cfg).trainer.report_to == [ReportTo.tensorboard]
    assert _cfg(make_cfg, "trainer.report_to=[mlflow,wandb]").trainer.report_to == [ReportTo.mlflow, ReportTo.wandb]
    assert _cfg(make_cfg, "trainer.report_to=[]").trainer.report_to == []
    with pytest.raises(ConfigError) as info:
        compose_and_load(["trainer.report_to=mlflow"])
    assert info.value.problems[0].startswith("trainer.report_to is a list: write trainer.report_to=[mlflow]")


def test_a_missing_extra_is_one_message(make_cfg, monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name in ("mlflow", "wandb")
                        else real(name))
    cfg = _cfg(make_cfg, "trainer.report_to=[tensorboard,mlflow,wandb]")
    assert trackers.preflight(cfg) == [
        "trainer.report_to: mlflow needs the mlflow package: pip install 'dsrecipes[mlflow]'",
        "trainer.report_to: wandb needs the wandb package: pip install 'dsrecipes[wandb]'",
    ]


def test_a_missing_extra_stops_the_run_with_exit_2(tmp_path, capsys, monkeypatch):
    from dsrecipes.cli import main

    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    run = tmp_path / "run"
    assert main(["trainer.report_to=[wandb]", f"trainer.output_dir={run}", f"hydra.run.dir={run}"]) == 2
    assert "error: trainer.report_to: wandb needs the wandb package: pip install 'dsrecipes[wandb]'" in \
        capsys.readouterr().err
    assert not (run / "config.yaml").exists() and not (run / "prepare_stats.json").exists()


def test_an_unusable_mlflow_store_is_one_message(make_cfg, tmp_path):
    pytest.importorskip("mlflow")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = _cfg(make_cfg, "trainer.report_to=[mlflow]", f"trainer.tracking_uri=file:{blocker}/store")
    (problem,) = trackers.preflight(cfg)
    assert problem.startswith(f"trainer.tracking_uri: cannot open the MLflow tracking store (file:{blocker}/store): ")


def test_a_failing_tracker_is_dropped_and_training_goes_on(tmp_path, capsys):
    class Broken:
        name = "broken"

        def log_metrics(self, metrics, step):
            raise ConnectionError("server gone")

    log = MetricsLogger(tmp_path, rank=0, total_steps=2, bar=False)
    log._trackers.append(Broken())
    for step in (1, 2):
        log.log_train(step=step, loss=1.0, lr=1e-3, grad_norm=None, tokens_per_s=1.0, samples_seen=1, elapsed=1.0)
    log.close()
    err = capsys.readouterr().err
    assert err.count("warning: broken: log_metrics failed (ConnectionError: server gone)") == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_mlflow_resumed_run_continues_the_same_mlflow_run(make_cfg, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    cfg = _cfg(make_cfg, "trainer.report_to=[mlflow]", f"trainer.tracking_uri={uri}", "trainer.experiment=resume")
    run_dir = tmp_path / "runs" / "r1"
    for start, steps in ((0, (1, 2, 3)), (2, (3, 4))):  # killed after step 3, resumed from the step-2 checkpoint
        log = MetricsLogger(run_dir, rank=0, total_steps=4, start_step=start, bar=False, cfg=cfg)
        for step in steps:
            log.log_train(step=step, loss=1.0 / step, lr=1e-3, grad_norm=None, tokens_per_s=1.0, samples_seen=1,
                          elapsed=1.0)
        if steps[-1] == 4:
            log.close()
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow_run_id"]
    client = MlflowClient(uri)
    (only,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert only.info.run_id == run_id and only.info.status == "FINISHED" and only.info.run_name == "runs/r1"
    assert only.data.tags["dsrecipes.resumed_at_step"] == "2"
    assert sorted({m.step for m in client.get_metric_history(run_id, "train/loss")}) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_real_run_reports_to_mlflow_and_wandb(tmp_path, monkeypatch):
    """A real training run, both optional trackers at once: MLflow on a local file store, W&B offline."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this test's own client (MLflow 3)
    wandb_missing = __import__("importlib").util.find_spec("wandb") is None
    report = "[tensorboard,mlflow]" if wandb_missing else "[tensorboard,mlflow,wandb]"
    run = tmp_path / "run"
    uri = f"file:{tmp_path / 'mlruns'}"
    done = subprocess.run([sys.executable, "-m", "dsrecipes", "debug=fast", f"trainer.output_dir={run}",
                           f"trainer.report_to={report}", f"trainer.tracking_uri={uri}", "trainer.experiment=e2e",
                           f"data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path, capture_output=True, text=True,
                          env=subprocess_env({"WANDB_MODE": "offline", "WANDB_SILENT": "true"}), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    params = mlrun.data.params
    assert params["trainer.max_steps"] == "8" and params["zero.stage"] == "0" and params["model.name"] == "tiny"
    assert json.loads(params["trainer.report_to"]) == json.loads(json.dumps(report[1:-1].split(",")))
    assert len(params) > 100, "the whole resolved config"
    history = client.get_metric_history(mlrun.info.run_id, "train/loss")
    assert [m.step for m in history] == [2, 4, 6, 8]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "eval/loss")] == [0, 4, 8]
    assert {a.path for a in client.list_artifacts(mlrun.info.run_id)} == {"loss.png", "config.yaml"}
    assert mlrun.info.status == "FINISHED"
    assert list((run / "tb").glob("events.out.tfevents.*"))
    if wandb_missing:
        pytest.skip("wandb is not installed: MLflow checked, W&B not")
    (offline,) = list((run / "wandb").glob("offline-run-*"))
    records = _wandb_records(next(offline.glob("run-*.wandb")))
    history = [{i.key or "/".join(i.nested_key): i.value_json for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    assert [int(h["_step"]) for h in history] == [0, 2, 4, 6, 8]  # step 0: the evaluation before training
    losses = [r["loss"] for r in _metrics(run) if "loss" in r]
    assert "train/loss" not in history[0] and "eval/loss" in history[0]  # the starting point is an evaluation only
    assert [float(h["train/loss"]) for h in history[1:]] == pytest.approx(losses)
    assert "eval/loss" in history[-1] and json.loads(history[-1]["loss/_type"]) == "image-file"  # loss.png
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [a.type for a in artifacts] == ["run-files"]
    assert {e.path for e in artifacts[0].manifest.contents} == {"loss.png", "config.yaml"}
    updates = [r.run.config.update if r.WhichOneof("record_type") == "run" else r.config.update for r in records
               if r.WhichOneof("record_type") in ("run", "config")]
    config = {i.key: i.value_json for update in updates for i in update}
    assert json.loads(config["trainer"])["max_steps"] == 8


def _metrics(run: Path):
    from dsrecipes.core.rundir import read_metrics

    return read_metrics(run)


def _wandb_records(path: Path) -> list:
    """The records of a `.wandb` file (a LevelDB-style log: 32 KiB blocks of checksummed, possibly split records)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pending, records = path.read_bytes(), 7, b"", []  # 7: the file's own header
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records
