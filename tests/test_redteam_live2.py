"""Red team, liveness (second round): a full disk under TensorBoard's event files, a pipeline stopped during a stage,
and `dsrecipes score` on a directory that is not a verified export.

Tried for real (launcher=local, debug=fast, report_to tensorboard, output_dir on a 40 MiB tmpfs filled by `dd` at
step 10): TensorBoard's writer thread printed its own 15-line traceback ('Exception in thread Thread-1: ...
OSError: [Errno 28] No space left on device'), then 'warning: tensorboard: log_metrics failed', and the run went on
until metrics.jsonl's write failed; with report_to=[] only that last failure was said.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from pathlib import Path

import pytest

from dsrecipes.observe import trackers


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_under_tensorboard_stops_the_run_without_the_threads_traceback(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)  # what the thread would print on the console
    tracker = trackers.TensorBoardTracker(tmp_path, 0)
    monkeypatch.setattr(record_writer.RecordWriter, "write", _no_space)  # the disk fills up mid-run
    alive = trackers.call_each([tracker], "log_metrics", {"train/loss": 1.0}, 1)
    deadline = time.monotonic() + 5
    while tracker.writer.file_writer.event_writer._async_writer._worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError) as raised:  # before: a warning, and the run went on writing to the full disk
        trackers.call_each(alive, "log_metrics", {"train/loss": 1.0}, 2)
    assert raised.value.errno == errno.ENOSPC
    assert printed == []  # before: the writer thread's traceback
    assert trackers.call_each([tracker], "close", False, stop_on_full=False) == []  # a failing run keeps its error


@pytest.mark.parametrize("ends", ["exit 143", "KeyboardInterrupt"])
def test_a_pipeline_stopped_during_a_stage_says_one_command_and_it_is_the_pipelines(tmp_path, monkeypatch, capsys,
                                                                                     ends):
    """Tried for real (SIGTERM to `dsrecipes pipeline` while its DPO stage trained): 'Resume with: cd ... python -m
    dsrecipes debug=fast ... trainer.output_dir=out/dpo' (the stage's own command) and then 'pipeline: stage 'dpo'
    (2 of 2) was interrupted; resume with: dsrecipes pipeline p.yaml --out out' (relative to where it was started).
    Now only the second, runnable from anywhere; run for real, it resumed DPO from its step-4 checkpoint."""
    import signal
    import sys

    import dsrecipes.commands.outcome as outcome
    import dsrecipes.commands.train as train
    from dsrecipes.cli import main

    def stage(argv):  # the training command interrupted by SIGTERM, as commands/train._launch ends it
        run_dir = Path(next(a for a in argv if a.startswith("trainer.output_dir=")).partition("=")[2])
        run_dir.mkdir(parents=True)
        code = outcome.report_interrupted(run_dir, signal.SIGTERM, {}, argv)
        if ends == "KeyboardInterrupt":
            raise KeyboardInterrupt
        return code

    monkeypatch.setattr(train, "main", stage)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text("stages:\n  - name: sft\n  - name: dpo\n    model_from: sft\n")
    code = main(["pipeline", "p.yaml", "--out", "out"])
    err = capsys.readouterr().err
    assert code == 143 if ends == "exit 143" else code in (130, 143), err
    assert err.lower().count("resume with") == 1, err  # before: the stage's command as well
    command = f"cd {tmp_path} && {sys.executable} -m dsrecipes pipeline p.yaml --out out"
    assert f"pipeline: stage 'sft' (1 of 2) was interrupted; resume with: {command}" in err, err
    assert json.loads((tmp_path / "out" / "sft" / "result.json").read_text())["resume_command"] == command


@pytest.fixture
def signed_reward(model_dir, tmp_path, monkeypatch):
    """The tiny model as a one-label reward model with an export marker signed by this user's key (a test key)."""
    import shutil

    from dsrecipes.boundary import trust
    from dsrecipes.core import manifest
    from dsrecipes.core.export_dir import EXPORT_MARKER

    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "key"))
    model = tmp_path / "reward"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    hashes = manifest.describe(model)
    trust.ensure_key()
    (model / EXPORT_MARKER).write_text(json.dumps(trust.sign({"files": sorted(hashes), "hashes": hashes})))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": [{"role": "user", "content": "a"}],
                                 "chosen": [{"role": "assistant", "content": "b"}],
                                 "rejected": [{"role": "assistant", "content": "c"}]}) + "\n", encoding="utf-8")
    return model, pairs


def test_score_checks_an_export_as_chat_does_before_loading_it(signed_reward, tmp_path, monkeypatch, capsys):
    """Tried for real: an objective=reward export with its chat template altered, and one signed with another
    user's key: `dsrecipes chat` refused both (damaged export / refusing to load this export), `dsrecipes score`
    loaded and scored both (exit 0)."""
    from dsrecipes.boundary import trust
    from dsrecipes.cli import main as cli_main
    from tests.conftest import in_process_environ
    from tests.test_messages_hostile import refused

    model, pairs = signed_reward
    out = tmp_path / "r.jsonl"
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "another_users_key"))
    trust.ensure_key()
    refused(capsys, ["score", str(model), "--pairs", str(pairs), "--out", str(out)], "refusing to load this export",
            f"dsrecipes score {model} --pairs {pairs} --trust-checkpoint {model}")
    assert not out.exists()
    with in_process_environ():  # trusted on the command line: scored
        assert cli_main(["score", str(model), "--pairs", str(pairs), "--out", str(out), "--trust-checkpoint",
                         str(model)]) == 0
    out.unlink()
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "key"))
    (model / "config.json").write_text((model / "config.json").read_text() + " ", encoding="utf-8")
    refused(capsys, ["score", str(model), "--pairs", str(pairs), "--out", str(out)], "damaged export",
            "config.json")
    assert not out.exists()


def test_score_refuses_a_directory_of_pickles_naming_its_own_argument(signed_reward, tmp_path, capsys):
    """A foreign directory whose weights are a pickle that runs a command when loaded: refused before anything is
    read (it was), and the message names score's own argument (before: 'model.path:', a training key)."""
    import pickle

    from tests.test_messages_hostile import refused

    model, pairs = signed_reward
    (model / "dsrecipes_export.json").unlink()
    (model / "model.safetensors").unlink()
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            import os
            return os.system, (f"touch {ran}",)

    (model / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    err = refused(capsys, ["score", str(model), "--pairs", str(pairs), "--out", str(tmp_path / "r.jsonl")],
                  f"error: EXPORT: {model} holds its weights as pickles (pytorch_model.bin)")
    assert "model.path" not in err and not ran.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A run directory on a 1 MiB tmpfs, and what fills that to the last byte (root only: skipped otherwise)."""
    import subprocess

    from tests.test_disk_full import mount_tmpfs

    disk = tmp_path / "disk"
    mount_tmpfs(disk, "1M")
    try:
        run_dir = disk / "run"
        (run_dir / "logs").mkdir(parents=True)
        yield run_dir, lambda: subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=64k"],
                                              capture_output=True)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)  # (a file a failing test left open)


def test_a_rank_stopped_by_a_full_disk_is_one_line_saying_so(small_disk, monkeypatch, capsys):
    """Tried for real (report_to=[], the dd run above): 'error: rank 0 failed: OSError: [Errno 28] ... (at
    dsrecipes/core/fileio.py:32) (traceback: RUN/logs/rank0.log)' - an empty log, and the place of a later write
    (loss.png, as the failed run closed its metrics) - then 'error: the ranks exited with code 1 without a report',
    'warning: RUN/result.json not written' and Hydra's 'UserWarning: Callback SweepSummary.on_job_end raised
    OSError' quoting a line of its source. Now the rank's line alone, saying the disk is full and how to go on."""
    from argparse import Namespace

    from hydra.core.utils import JobStatus
    from omegaconf import OmegaConf

    import dsrecipes.rank.worker as worker
    from dsrecipes.commands.outcome import conclude
    from dsrecipes.observe.metrics import MetricsLogger
    from dsrecipes.observe.sweep import SweepSummary

    full_disk, fill = small_disk
    logger = MetricsLogger(full_disk, 0, 8, bar=False, cfg=Namespace(trainer=Namespace(report_to=[])))
    logger.log_train(1, 1.0, 1e-3, None, 1.0, 4, 1.0)
    fill()
    logger.close(ok=False)  # before: OSError from loss.png, in place of the run's own error
    monkeypatch.setattr(worker, "end_workers", lambda: None)
    monkeypatch.setenv("RANK", "0")
    assert worker.failed(full_disk, OSError(errno.ENOSPC, "No space left on device")) == 1
    assert conclude(full_disk, 1, False, []) == (1, False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: rank 0 failed: OSError: [Errno 28]"), err
    assert f"the disk of {full_disk} is full" in err and "(no checkpoint yet: it starts from step 1)" in err
    assert sorted(p.name for p in full_disk.iterdir()) == ["logs", "metrics.jsonl"]
    job = OmegaConf.create({"trainer": {"output_dir": str(full_disk)},
                            "hydra": {"mode": "RUN", "runtime": {"output_dir": str(full_disk)}}})
    SweepSummary().on_job_end(job, Namespace(status=JobStatus.COMPLETED))  # before: OSError (Hydra's warning)
