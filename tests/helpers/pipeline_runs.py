"""The real `dsrecipes pipeline` in a process of its own on the tiny model, held at a known place and signalled or
killed there (tests/test_review_pipeline_interrupts.py, tests/test_review_pipeline_hostile.py); the resume that
follows, the same command, may run in the test process (rerun's capfd), the start of a Python being ~4 of its 6 CPU s.

Windows the product has no hook for (between stages) are held by a sitecustomize shim written here (tests/faults.py's
way in: a directory of the test's own in front of PYTHONPATH); the training windows use tests/faults.py's
pause_after_step."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from dsrecipes.run.pipeline import STATE_FILE
from tests.conftest import REPO, in_process_environ, subprocess_env
from tests.faults import fault_env
from tests.test_pipeline import TINY as PIPELINE_TINY

# tests/test_pipeline.py's tiny SFT -> DPO, without prompt answers, SFT 3 steps (a step between its first and last)
TINY = PIPELINE_TINY.replace("prompts: {limit: 2, max_new_tokens: 4}\n", "").replace("max_steps: 2}", "max_steps: 3}")
assert "max_steps: 3}" in TINY and "prompts" not in TINY

# SFT's rank under torchrun (the stage the torchrun tests stop or kill); DPO, which they only resume to compare with
# the reference (itself run in-process), in the pipeline's process: a second torchrun and rank cost ~6 CPU s a resume
TORCHRUN = TINY.replace("      optimizer.lr: 1.0e-3\n",
                        "      optimizer.lr: 1.0e-3\n      launcher: torchrun\n      launcher.num_gpus: 1\n")
assert TORCHRUN.count("launcher: torchrun") == 1

# Hand-over windows: `before_record` holds the pipeline after stage 1's run returned, before its record says done;
# `after_record` after the record, before stage 2 is looked at; `stage_2_recorded` once stage 2 is recorded running,
# before its run starts; `stage_2_preparing` inside stage 2's train command, its run directory claimed, before the
# launch. The held process writes HELD beside this file and sleeps (a signal ends the sleep the way it ends any other
# line of the pipeline's or train's own code).
HOOK = '''"""Written by tests/helpers/pipeline_runs.py: holds `dsrecipes pipeline` between its stages (or in stage 2's
preparation)."""
import json as _json
import os as _os
import time as _time

_here = _os.path.dirname(_os.path.abspath(__file__))
with open(_os.path.join(_here, "hook.json"), encoding="utf-8") as _fh:
    _where = _json.load(_fh)["where"]


def _hold():
    open(_os.path.join(_here, "HELD"), "w").close()
    _deadline = _time.monotonic() + 60
    while _time.monotonic() < _deadline:
        _time.sleep(0.05)


import dsrecipes.run.pipeline as _pipeline  # noqa: E402

if _where in ("before_record", "stage_2_recorded"):
    _record = _pipeline.PipelineRun.record

    def _held_record(self, stage, **fields):
        if _where == "before_record" and stage.name == "sft" and fields.get("status") == "done" and "argv" not in fields:
            _hold()
        _record(self, stage, **fields)
        if _where == "stage_2_recorded" and stage.name == "dpo" and fields.get("status") == "running":
            _hold()

    _pipeline.PipelineRun.record = _held_record
elif _where == "stage_2_preparing":  # inside stage 2's train command: its run directory claimed, before the launch
    import dsrecipes.commands.train as _train

    _launch = _train.run

    def _held_launch(cfg, decision=None):
        if str(cfg.trainer.output_dir).endswith("/dpo"):
            _hold()
        return _launch(cfg, decision)

    _train.run = _held_launch
else:
    _run_stage = _pipeline.run_stage

    def _held_run_stage(run, stage, number, train):
        code = _run_stage(run, stage, number, train)
        if stage.name == "sft":
            _hold()
        return code

    _pipeline.run_stage = _held_run_stage
'''


def hook_env(where: Path, window: str) -> Tuple[Dict[str, str], Path]:
    folder = where / f"hook-{window}"
    folder.mkdir()
    (folder / "hook.json").write_text(json.dumps({"where": window}), encoding="utf-8")
    (folder / "sitecustomize.py").write_text(HOOK, encoding="utf-8")
    return {"PYTHONPATH": f"{folder}{os.pathsep}{REPO}"}, folder / "HELD"


def write(tmp_path: Path, text: str = TINY) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def command(path: Path, out: Path) -> List[str]:
    return [sys.executable, "-m", "dsrecipes", "pipeline", str(path), "--out", str(out)]


def start(tmp_path: Path, path: Path, out: Path, env: Optional[Dict[str, str]] = None, log: str = "first.log"):
    fh = open(tmp_path / log, "wb")
    proc = subprocess.Popen(command(path, out), cwd=tmp_path, env=subprocess_env(env or {}), start_new_session=True,
                            stdout=fh, stderr=subprocess.STDOUT)
    fh.close()
    return proc


def wait_for(proc: subprocess.Popen, path: Path, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            pytest.fail(f"{path} never appeared (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


def ended(proc: subprocess.Popen, log: Path, within: float = 30) -> Tuple[int, str]:
    """The process's exit code and console, once it ended (at most `within` s after it was told to)."""
    try:
        code = proc.wait(within)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail(f"still running {within:.0f} s after the signal:\n{log.read_text()[-3000:]}")
    return code, log.read_text(errors="replace")


def paused(tmp_path: Path, out: Path, stage: str, step: int) -> Tuple[Dict[str, str], Path]:
    """tests/faults.py's pause_after_step=STEP (in every stage that has the step) and what says the run is there."""
    return fault_env(tmp_path, pause_after_step=step), out / stage / "checkpoints" / f"step_{step}"


def held_then(tmp_path: Path, path: Path, out: Path, env: Dict[str, str], held: Path, signum: int) -> Tuple[int, str]:
    """The pipeline started, held until `held` appears, then sent `signum`: its exit code and console."""
    proc = start(tmp_path, path, out, env)
    wait_for(proc, held, tmp_path / "first.log")
    proc.send_signal(signum)
    return ended(proc, tmp_path / "first.log")


def rerun(tmp_path: Path, path: Path, out: Path, log: str = "again.log", capfd=None) -> str:
    """The same command, no faults: it must finish. In a process of its own; or, given pytest's `capfd`, in this
    one (`dsrecipes.cli.main` with the environment and directory that process would have had, and its console read
    back from the file descriptors): the same command on the same files without paying for Python, torch and
    transformers to start again (about 4 CPU s of the 6 s a pipeline of TINY costs)."""
    if capfd is not None:
        return _rerun_here(tmp_path, command(path, out)[3:], tmp_path / log, capfd)
    done = subprocess.run(command(path, out), cwd=tmp_path, env=subprocess_env({"PYTHONPATH": str(REPO)}),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    text = done.stdout.decode(errors="replace")
    (tmp_path / log).write_text(text)
    assert done.returncode == 0, text[-3000:]
    return text


def _rerun_here(cwd: Path, args: List[str], log: Path, capfd) -> str:
    from dsrecipes.cli import main

    if capfd is not None:
        capfd.readouterr()
    before, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(cwd)
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 has it in that process (subprocess_env): the same float sums
    try:
        with in_process_environ(subprocess_env({"PYTHONPATH": str(REPO)})):
            code = main(args)
    finally:
        os.chdir(before)
        torch.set_num_threads(threads)
    got = capfd.readouterr() if capfd is not None else None
    text = got.out + got.err if got is not None else "(the console went to pytest's capture)\n"
    log.write_text(text)
    assert code == 0, text[-3000:]
    return text


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def losses(run_dir: Path) -> Dict[int, float]:
    """Train loss per step, the last logged value of a step (a resumed run may log a redone step again)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def stages(out: Path) -> Dict[str, dict]:
    return json.loads((out / STATE_FILE).read_text())["stages"]


def uninterrupted(tmp: Path) -> Dict[str, dict]:
    """An uninterrupted run of TINY in `tmp`: what every interrupted-then-resumed run must end with (each test
    module's `reference` fixture)."""
    path, out = write(tmp), tmp / "out"
    _rerun_here(tmp, command(path, out)[3:], tmp / "reference.log", None)  # as rerun(capfd=...): no 4 s start
    return {s: {"export": digest(out / s / "export" / "model.safetensors"), "losses": losses(out / s)}
            for s in ("sft", "dpo")}


def assert_same_as_uninterrupted(out: Path, reference: Dict[str, dict]) -> None:
    for stage in ("sft", "dpo"):
        assert losses(out / stage) == reference[stage]["losses"], stage
        assert digest(out / stage / "export" / "model.safetensors") == reference[stage]["export"], stage
    assert [s["status"] for s in stages(out).values()] == ["done", "done"]


def assert_one_message(text: str) -> None:
    assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]


def in_process(args: List[str], capsys) -> Tuple[int, str]:
    from dsrecipes.cli import main

    with in_process_environ():
        code = main(args)
    return code, capsys.readouterr().err


def interrupted_in_stage_1(tmp_path: Path) -> Tuple[Path, Path]:
    """TINY stopped by SIGTERM in SFT (paused after step 1; stops at step 2 with its checkpoint)."""
    path, out = write(tmp_path), tmp_path / "out"
    got, text = held_then(tmp_path, path, out, *paused(tmp_path, out, "sft", 1), signal.SIGTERM)
    assert got == 143 and stages(out)["sft"]["status"] == "interrupted", text[-3000:]
    return path, out


class Stage1Interrupted:
    """interrupted_in_stage_1 paid for once (a test module's fixture): `fresh()` puts the run back as the signal left
    it, at the very paths it was made at (its state and checkpoints name them), for the next test to edit and resume."""

    def __init__(self, tmp: Path):
        self.path, self.out = interrupted_in_stage_1(tmp)
        self.kept = tmp / "as_interrupted"
        shutil.copytree(self.out, self.kept, symlinks=True)

    def fresh(self) -> Tuple[Path, Path]:
        shutil.rmtree(self.out)
        shutil.copytree(self.kept, self.out, symlinks=True)
        write(self.path.parent)
        assert stages(self.out)["sft"]["status"] == "interrupted"
        return self.path, self.out
