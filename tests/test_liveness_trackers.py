"""An MLflow tracking server that accepts connections and never answers: the launching process's preflight ends
within MLflow's request timeout x (retries + 1) with one problem naming trainer.tracking_uri and the server, after
a console line saying what it waits for (observe/trackers.py sets MLFLOW_HTTP_REQUEST_TIMEOUT / _MAX_RETRIES unless
the user did). Before: MLflow's defaults (120 s a request, 7 retries with backoff) held it ~20 minutes, silent, and
rank 0 as long at a log step mid-run."""

from __future__ import annotations

import importlib.util

import pytest

from dsrecipes.core.schema import ReportTo, TrainConfig
from dsrecipes.observe import trackers
from tests.fault_cases import outcome_within, silent_server


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="the mlflow extra is not installed")
def test_a_silent_mlflow_server_is_one_problem_within_its_bound(monkeypatch, capsys):
    for key in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(trackers, "MLFLOW_REQUEST_S", 1, raising=False)  # (absent before: MLflow's 120 s x 8)
    monkeypatch.setattr(trackers, "MLFLOW_RETRIES", 0, raising=False)
    monkeypatch.setattr(trackers, "WAIT_NOTE_S", 0.3, raising=False)
    cfg = TrainConfig()
    cfg.trainer.report_to = [ReportTo.mlflow]
    with silent_server() as uri:
        cfg.trainer.tracking_uri = uri
        found, took = outcome_within(lambda: trackers.preflight(cfg), 30)  # (old code: still waiting here)
    assert took < 10, took
    (problem,) = found
    assert problem.startswith(f"trainer.tracking_uri: cannot open the MLflow tracking store ({uri}): "), problem
    waiting = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dsrecipes: waiting for the MLflow")]
    assert len(waiting) == 1 and uri in waiting[0] and "up to 1 s a request, 0 retries" in waiting[0], waiting
