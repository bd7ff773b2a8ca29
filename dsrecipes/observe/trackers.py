"""Experiment trackers (`trainer.report_to`): TensorBoard (default), MLflow and Weights & Biases behind one small
interface, so metrics.py reports the same numbers to each. Rank 0 only.

A tracker gets the resolved config as flat parameters at the start, `train/loss`, `train/lr`, `train/grad_norm`,
`train/tokens_per_s` and `eval/loss` at every log line, and the run's loss.png and config.yaml at the end. A resumed
run continues the same MLflow / W&B run (their ids are kept in `<run>/trackers.json`). MLflow and wandb are
optional extras: `preflight()` turns a missing package or an unreachable MLflow store into one message in the
launching process, before any data is prepared. A tracker that fails mid-run is reported once and dropped:
training goes on (metrics.jsonl keeps every number).

Where the numbers and the user's credentials go is the user's choice only: `trainer.tracking_uri` is a user-named
field (config/field_classes.py), so a shared recipe's value is refused on the composition before `preflight` opens
anything (MLFLOW_TRACKING_TOKEN goes only to the server the command line, MLFLOW_TRACKING_URI or conf/ named); W&B's
host comes from the user's own WANDB_BASE_URL / login, which no recipe can set (launcher.env is allow-listed).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol

from dsrecipes.core.fileio import atomic_write_json
from dsrecipes.core.schema import ReportTo, TrainConfig
from dsrecipes.core.typed import config_to_dict

TB_DIR = "tb"
IDS_FILE = "trackers.json"
# A silent MLflow server: MLflow's own defaults (120 s a request, 7 retries with backoff) hold the launching process
# or rank 0 for ~20 minutes per call; with these, ~40 s, then its one message (preflight) or warning (mid-run).
MLFLOW_REQUEST_S, MLFLOW_RETRIES = 10, 2
WAIT_NOTE_S = 3.0  # a preflight wait longer than this is said on the console
_PACKAGE = {ReportTo.mlflow: "mlflow", ReportTo.wandb: "wandb"}
_PARAM_MAX = 6000  # MLflow's limit on a parameter value
_FULL = {errno.ENOSPC, errno.EDQUOT}  # a full disk (or quota) under the run directory


class Tracker(Protocol):
    name: str

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None: ...

    def log_artifacts(self, paths: List[Path]) -> None: ...

    def close(self, ok: bool) -> None: ...


def preflight(cfg: TrainConfig) -> List[str]:
    """Problems that would stop a tracker at rank 0, found in the launching process (exit 2 before any work)."""
    problems = [f"trainer.report_to: {kind.value} needs the {_PACKAGE[kind]} package: pip install "
                f"'dsrecipes[{kind.value}]'" for kind in dict.fromkeys(cfg.trainer.report_to)
                if kind in _PACKAGE and importlib.util.find_spec(_PACKAGE[kind]) is None]
    if not problems and ReportTo.mlflow in cfg.trainer.report_to:
        uri = cfg.trainer.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "MLflow's default"
        note = threading.Timer(WAIT_NOTE_S, lambda: print(
            f"dsrecipes: waiting for the MLflow tracking store ({uri}): up to {os.environ['MLFLOW_HTTP_REQUEST_TIMEOUT']}"
            f" s a request, {os.environ['MLFLOW_HTTP_REQUEST_MAX_RETRIES']} retries", file=sys.stderr, flush=True))
        note.daemon = True
        try:
            client = _mlflow_client(cfg)
            note.start()
            _mlflow_experiment(client, cfg.trainer.experiment)
        except Exception as exc:  # noqa: BLE001 - any failure to open the store is the user's setting
            problems.append(f"trainer.tracking_uri: cannot open the MLflow tracking store ({uri}): "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        finally:
            note.cancel()
    return problems


def open_trackers(cfg: Optional[TrainConfig], run_dir: Path, start_step: int) -> List[Tracker]:
    """The trackers of `cfg.trainer.report_to` (TensorBoard alone without a config), in that order."""
    kinds = [ReportTo.tensorboard] if cfg is None else list(dict.fromkeys(cfg.trainer.report_to))
    ids = _read_ids(run_dir)
    trackers = [OPENERS[kind](cfg, run_dir, start_step, ids) for kind in kinds]
    if ids:
        atomic_write_json(run_dir / IDS_FILE, ids)
    return trackers


def run_name(run_dir: Path) -> str:
    """`2026-01-31/12-00-00` for a Hydra run directory, `12-00-00/3` for job 3 of a sweep."""
    return f"{run_dir.parent.name}/{run_dir.name}"


def flat_params(cfg: TrainConfig) -> Dict[str, str]:
    """The resolved config as `{"trainer.max_steps": "400", ...}` (lists and mappings as JSON)."""

    out: Dict[str, str] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            out[re.sub(r"[^\w\-. /]", "_", key)] = text[:_PARAM_MAX]

    walk(config_to_dict(cfg), "")
    return out


# ---------------------------------------------------------------------------------------------------------------


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        # purge_step hides events a killed run wrote past the checkpoint we resume from.
        self.writer = SummaryWriter(log_dir=str(run_dir / TB_DIR), purge_step=start_step + 1 if start_step else None)

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_artifacts(self, paths: List[Path]) -> None:
        self.writer.flush()

    def close(self, ok: bool) -> None:
        self.writer.close()


def _quiet_writer_threads() -> None:
    """TensorBoard writes its events from a thread that keeps its error (a full disk) and raises it again at the
    writer's next call here, where call_each says it; left alone, the thread also printed its own traceback."""
    previous = threading.excepthook
    if getattr(previous, "dsrecipes_tensorboard", False):
        return

    def hook(args: Any) -> None:
        kept = getattr(args.thread, "exception", None) is args.exc_value
        if not (kept and type(args.thread).__module__.startswith("tensorboard.")):
            previous(args)

    hook.dsrecipes_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class MlflowTracker:
    name = "mlflow"

    def __init__(self, cfg: TrainConfig, run_dir: Path, start_step: int, ids: Dict[str, str]):
        self.client = _mlflow_client(cfg)
        self.run_id = ids.get("mlflow_run_id")
        if self.run_id is None:
            experiment = _mlflow_experiment(self.client, cfg.trainer.experiment)
            run = self.client.create_run(experiment, run_name=run_name(run_dir),
                                         tags={"dsrecipes.run_dir": str(run_dir)})
            self.run_id = ids["mlflow_run_id"] = run.info.run_id
            self._log_params(flat_params(cfg))
        else:  # a resumed run: same MLflow run, parameters as first logged
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "dsrecipes.resumed_at_step", str(start_step))

    def _log_params(self, params: Dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_artifacts(self, paths: List[Path]) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class WandbTracker:
    name = "wandb"

    def __init__(self, cfg: TrainConfig, run_dir: Path, start_step: int, ids: Dict[str, str]):
        import wandb

        # console="off": W&B would otherwise wrap this process's stdout/stderr to upload them. silent: its banner
        # (~20 lines at start and end) stays off the console; W&B keeps its own logs in <run>/wandb/.
        self.run = wandb.init(project=cfg.trainer.experiment, name=run_name(run_dir), dir=str(run_dir),
                              config=config_to_dict(cfg), id=ids.get("wandb_run_id"), resume="allow",
                              settings=wandb.Settings(console="off", silent=True))
        ids["wandb_run_id"] = self.run.id

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_artifacts(self, paths: List[Path]) -> None:
        import wandb

        files = wandb.Artifact(name=f"run-{self.run.id}-files", type="run-files")
        for path in paths:
            files.add_file(str(path))
            if path.suffix == ".png":
                self.run.log({path.stem: wandb.Image(str(path))})  # shown beside the curves
        self.run.log_artifact(files)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


OPENERS: Dict[ReportTo, Callable[..., Tracker]] = {
    ReportTo.tensorboard: lambda cfg, run_dir, start_step, ids: TensorBoardTracker(run_dir, start_step),
    ReportTo.mlflow: MlflowTracker,
    ReportTo.wandb: WandbTracker,
}


def call_each(trackers: List[Tracker], method: str, *args: Any, stop_on_full: bool = True) -> List[Tracker]:
    """Call `method` on every tracker; one that raises is reported once and left out from then on. A full disk under
    TensorBoard's files is the run's own disk: it stops the run as metrics.jsonl's write would (`stop_on_full`
    False: a run that already failed keeps its own error)."""
    alive = []
    for tracker in trackers:
        try:
            getattr(tracker, method)(*args)
            alive.append(tracker)
        except OSError as exc:
            if stop_on_full and tracker.name == TensorBoardTracker.name and exc.errno in _FULL:
                raise  # the run directory's disk is full: the run stops as at any other write there
            _dropped(tracker, method, exc)
        except Exception as exc:  # noqa: BLE001 - a dashboard must not end a training run
            _dropped(tracker, method, exc)
    return alive


def _dropped(tracker: Tracker, method: str, exc: BaseException) -> None:
    print(f"warning: {tracker.name}: {method} failed ({type(exc).__name__}: {exc}); "
          "no more reporting to it in this run (metrics.jsonl has every number)", file=sys.stderr)


def _mlflow_client(cfg: TrainConfig) -> Any:
    from mlflow.tracking import MlflowClient

    uri = cfg.trainer.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    for key, value in (("MLFLOW_HTTP_REQUEST_TIMEOUT", MLFLOW_REQUEST_S), ("MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                                                                           MLFLOW_RETRIES)):
        os.environ.setdefault(key, str(value))  # (read by MLflow at each request; the user's own settings win)
    if uri and uri.startswith("file:"):
        # MLflow 3 refuses its file store unless told otherwise; naming a file: URI is telling it.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def _mlflow_experiment(client: Any, name: str) -> str:
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


def _read_ids(run_dir: Path) -> Dict[str, str]:
    path = run_dir / IDS_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
