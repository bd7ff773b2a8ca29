"""`dsrecipes pipeline` under interruption and hostile conditions, as a sceptic tests it: the real command in its own
process on the tiny model (SFT 3 steps -> DPO 6 steps, one checkpoint per step, about 7 s uninterrupted).

- SIGTERM and SIGINT while stage 1 trains, in the hand-over between the stages (stage 1's run ended, its record
  not yet written; recorded, stage 2 not yet started) and while stage 2 trains: the process ends at once with the
  signal's exit code, one message naming the stage and the resume command, no traceback; the same command then
  never runs a finished stage again, resumes the interrupted one from its checkpoint, and ends with the very
  weights an uninterrupted run exports.
- `--out` at a non-empty directory that is not ours, at a stage directory someone else wrote: refused, their
  files untouched.
- The pipeline file edited between the interrupted run and the resume: refused naming the stage and the key.
- A stage's rank (a child process, launcher=torchrun) SIGKILLed: the pipeline ends within seconds naming the stage,
  no process of it left.

Windows the product has no hook for are held by a sitecustomize shim written here (tests/faults.py's way in: a
directory of the test's own in front of PYTHONPATH); the training windows use tests/faults.py's pause_after_step."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import psutil
import pytest

from dsrecipes.run.pipeline import LOCK_FILE, STATE_FILE
from tests.conftest import REPO, in_process_environ, subprocess_env
from tests.faults import fault_env

pytestmark = pytest.mark.slow

TINY = """\
shared:
  debug: fast
  data.cutoff_len: 512
  dataset: {max_samples: 40, val_size: 8}
  trainer: {save_every: 1, eval_every: 0, max_steps: 3}
stages:
  - name: sft
    set:
      optimizer.lr: 1.0e-3
  - name: dpo
    model_from: sft
    set:
      objective: dpo
      dataset: sample_pairs
      dataset.split.shares: {reward: 1, dpo: 1}
      dataset.split.take: dpo
      trainer.max_steps: 6
"""

TORCHRUN = TINY.replace("  debug: fast\n", "  debug: fast\n  launcher: torchrun\n  launcher.num_gpus: 1\n")

# Hand-over windows: `before_record` holds the pipeline after stage 1's run returned, before its record says done;
# `after_record` after the record, before stage 2 is looked at; `stage_2_recorded` once stage 2 is recorded running,
# before its run starts. The held process writes HELD beside this file and sleeps
# (a signal ends the sleep the way it ends any other line of the pipeline's own code).
HOOK = '''"""Written by tests/test_review_pipeline_interrupts.py: holds `dsrecipes pipeline` between its stages."""
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


def rerun(tmp_path: Path, path: Path, out: Path, log: str = "again.log") -> str:
    """The same command, no faults: it must finish."""
    done = subprocess.run(command(path, out), cwd=tmp_path, env=subprocess_env({"PYTHONPATH": str(REPO)}),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    text = done.stdout.decode(errors="replace")
    (tmp_path / log).write_text(text)
    assert done.returncode == 0, text[-3000:]
    return text


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def losses(run_dir: Path) -> Dict[int, float]:
    """Train loss per step, the last logged value of a step (a resumed run may log a redone step again)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def stages(out: Path) -> Dict[str, dict]:
    return json.loads((out / STATE_FILE).read_text())["stages"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Dict[str, object]:
    """An uninterrupted run of TINY: what every interrupted-then-resumed run must end with."""
    tmp = tmp_path_factory.mktemp("reference")
    path, out = write(tmp), tmp / "out"
    rerun(tmp, path, out, "reference.log")
    return {s: {"export": digest(out / s / "export" / "model.safetensors"), "losses": losses(out / s)}
            for s in ("sft", "dpo")}


def assert_same_as_uninterrupted(out: Path, reference: Dict[str, dict]) -> None:
    for stage in ("sft", "dpo"):
        assert losses(out / stage) == reference[stage]["losses"], stage
        assert digest(out / stage / "export" / "model.safetensors") == reference[stage]["export"], stage
    assert [s["status"] for s in stages(out).values()] == ["done", "done"]


def assert_one_message(text: str) -> None:
    assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]


STOPS = [(signal.SIGTERM, 143), (signal.SIGINT, 130)]


@pytest.mark.parametrize("signum, code", STOPS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_stage_1_trains_resumes_it_from_its_checkpoint(tmp_path, reference, signum, code):
    path, out = write(tmp_path), tmp_path / "out"
    proc = start(tmp_path, path, out, fault_env(tmp_path, pause_after_step=1))
    wait_for(proc, out / "sft" / "checkpoints" / "step_1", tmp_path / "first.log")
    proc.send_signal(signum)
    got, text = ended(proc, tmp_path / "first.log")
    assert got == code, text[-3000:]
    assert_one_message(text)
    assert "pipeline: stage 'sft' (1 of 2) was interrupted; resume with: " in text, text[-3000:]
    assert stages(out)["sft"]["status"] == "interrupted" and "dpo" not in stages(out)
    assert not (out / "dpo").exists() and not (out / "sft" / "checkpoints" / "step_3").exists()
    again = rerun(tmp_path, path, out)
    assert "stage 'sft' (1 of 2) (resumed: the run continues from its newest checkpoint)" in again
    assert json.loads((out / "sft" / "plan.json").read_text())["resume"] is not None
    assert_same_as_uninterrupted(out, reference)


@pytest.mark.parametrize("signum, code", STOPS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_in_stage_1s_last_step_stops_the_pipeline_before_stage_2(tmp_path, reference, signum, code):
    """Stage 1 at its last step when the signal comes: it ends as a run does there (exported, done), and the
    pipeline stops before stage 2: the signal is the user's (a preemption's) word for the whole command."""
    path, out = write(tmp_path), tmp_path / "out"
    proc = start(tmp_path, path, out, fault_env(tmp_path, pause_after_step=3))  # SFT's last step; DPO never gets there
    wait_for(proc, out / "sft" / "checkpoints" / "step_3", tmp_path / "first.log")
    proc.send_signal(signum)
    got, text = ended(proc, tmp_path / "first.log")
    assert got == code, text[-3000:]
    assert_one_message(text)
    assert "resume with: " in text.rpartition("exported Hugging Face model")[2], text[-3000:]
    assert not (out / "dpo").exists()
    assert stages(out)["sft"]["status"] == "done" and "dpo" not in stages(out)
    again = rerun(tmp_path, path, out)
    assert "pipeline: stage 'sft' (1 of 2) is done" in again, again
    assert_same_as_uninterrupted(out, reference)


@pytest.mark.parametrize("window", ["before_record", "after_record", "stage_2_recorded"])
@pytest.mark.parametrize("signum, code", STOPS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_between_the_stages_never_runs_stage_1_again(tmp_path, reference, window, signum, code):
    path, out = write(tmp_path), tmp_path / "out"
    env, held = hook_env(tmp_path, window)
    proc = start(tmp_path, path, out, env)
    wait_for(proc, held, tmp_path / "first.log")
    proc.send_signal(signum)
    got, text = ended(proc, tmp_path / "first.log")
    assert got == code, text[-3000:]
    assert_one_message(text)
    assert "resume with: " in text.rpartition("exported Hugging Face model")[2], text[-3000:]
    assert not (out / "dpo").exists()
    sft_result = (out / "sft" / "result.json").stat().st_mtime_ns
    again = rerun(tmp_path, path, out)
    assert "pipeline: stage 'sft' (1 of 2) is done" in again and "stage 'sft' (1 of 2):" not in again, again
    assert (out / "sft" / "result.json").stat().st_mtime_ns == sft_result
    assert_same_as_uninterrupted(out, reference)


@pytest.mark.parametrize("signum, code", STOPS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_stage_2_trains_resumes_it_without_stage_1(tmp_path, reference, signum, code):
    path, out = write(tmp_path), tmp_path / "out"
    proc = start(tmp_path, path, out, fault_env(tmp_path, pause_after_step=4))  # SFT has 3 steps: DPO is held
    wait_for(proc, out / "dpo" / "checkpoints" / "step_4", tmp_path / "first.log")
    proc.send_signal(signum)
    got, text = ended(proc, tmp_path / "first.log")
    assert got == code, text[-3000:]
    assert_one_message(text)
    assert "pipeline: stage 'dpo' (2 of 2) was interrupted; resume with: " in text, text[-3000:]
    assert [stages(out)[s]["status"] for s in ("sft", "dpo")] == ["done", "interrupted"]
    sft_result = (out / "sft" / "result.json").stat().st_mtime_ns
    again = rerun(tmp_path, path, out)
    assert "pipeline: stage 'sft' (1 of 2) is done" in again, again
    assert (out / "sft" / "result.json").stat().st_mtime_ns == sft_result
    assert json.loads((out / "dpo" / "plan.json").read_text())["resume"] is not None
    assert_same_as_uninterrupted(out, reference)


def in_process(args: List[str], capsys) -> Tuple[int, str]:
    from dsrecipes.cli import main

    with in_process_environ():
        code = main(args)
    return code, capsys.readouterr().err


def test_out_at_a_directory_that_is_not_ours_is_refused_and_left_as_it_was(tmp_path, capsys):
    path, out = write(tmp_path), tmp_path / "theirs"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = in_process(["pipeline", str(path), "--out", str(out)], capsys)
    assert code == 2 and f"--out: {out} is not empty (notes.txt)" in err, err
    assert_one_message(err)
    assert sorted(os.listdir(out)) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    forged = tmp_path / "forged"  # a marker that is not ours: refused, nothing written
    forged.mkdir()
    (forged / "dsrecipes_pipeline.json").write_text('{"dsrecipes_pipeline": "yes"}')
    code, err = in_process(["pipeline", str(path), "--out", str(forged)], capsys)
    assert code == 2 and "is not our marker" in err, err
    assert os.listdir(forged) == ["dsrecipes_pipeline.json"]


def test_a_stage_directory_someone_else_wrote_is_refused_naming_the_stage(tmp_path, capsys):
    path, out = write(tmp_path), tmp_path / "out"
    (out / "sft").mkdir(parents=True)
    (out / "dsrecipes_pipeline.json").write_text('{"dsrecipes_pipeline": 1}')  # the pipeline directory is ours
    (out / "sft" / "mine.txt").write_text("mine")  # its stage directory is not
    code, err = in_process(["pipeline", str(path), "--out", str(out)], capsys)
    assert code == 2 and "pipeline: stage 'sft' (1 of 2) failed (exit 2)" in err, err
    assert f"{(out / 'sft').resolve()} is not empty (mine.txt)" in err, err
    assert_one_message(err)
    assert os.listdir(out / "sft") == ["mine.txt"] and (out / "sft" / "mine.txt").read_text() == "mine"
    assert not (out / "dpo").exists()


def interrupted_in_stage_1(tmp_path: Path) -> Tuple[Path, Path]:
    """TINY stopped by SIGTERM in SFT (paused after step 1; stops at step 2 with its checkpoint)."""
    path, out = write(tmp_path), tmp_path / "out"
    proc = start(tmp_path, path, out, fault_env(tmp_path, pause_after_step=1))
    wait_for(proc, out / "sft" / "checkpoints" / "step_1", tmp_path / "first.log")
    proc.send_signal(signal.SIGTERM)
    got, text = ended(proc, tmp_path / "first.log")
    assert got == 143 and stages(out)["sft"]["status"] == "interrupted", text[-3000:]
    return path, out


@pytest.mark.parametrize("old, new, key", [
    ("  dataset: {max_samples: 40, val_size: 8}\n", "  dataset: {max_samples: 32, val_size: 8}\n",
     "dataset.max_samples"),
    ("  trainer: {save_every: 1, eval_every: 0, max_steps: 3}\n",
     "  trainer: {save_every: 1, eval_every: 0, max_steps: 3, seed: 7}\n", "trainer.seed"),
])
def test_the_file_edited_before_the_resume_is_refused_naming_the_stage_and_key(tmp_path, capsys, old, new, key):
    path, out = interrupted_in_stage_1(tmp_path)
    path.write_text(TINY.replace(old, new))
    checkpoints = sorted(os.listdir(out / "sft" / "checkpoints"))
    code, err = in_process(["pipeline", str(path), "--out", str(out)], capsys)
    assert code == 2 and "pipeline: stage 'sft' (1 of 2) failed (exit 2)" in err, err
    assert key in err, err
    assert_one_message(err)
    assert sorted(os.listdir(out / "sft" / "checkpoints")) == checkpoints and not (out / "dpo").exists()


def test_a_stage_whose_rank_is_sigkilled_ends_the_pipeline_in_seconds_leaving_no_process(tmp_path, reference):
    """launcher=torchrun, one rank: the rank is a child process of the pipeline (torchrun's), killed while it holds
    after step 1; the pipeline names the stage and ends, every process it started is gone."""
    path, out = write(tmp_path, TORCHRUN), tmp_path / "out"
    proc = start(tmp_path, path, out, fault_env(tmp_path, pause_after_step=1))
    wait_for(proc, out / "sft" / "checkpoints" / "step_1", tmp_path / "first.log", timeout=90)
    family = psutil.Process(proc.pid).children(recursive=True)
    ranks = [p for p in family if "dsrecipes.rank.worker" in p.cmdline() and "torch.distributed.run" not in p.cmdline()]
    assert len(ranks) == 1, [p.cmdline() for p in family]
    ranks[0].kill()
    killed_at = time.monotonic()
    got, text = ended(proc, tmp_path / "first.log", within=30)
    took = time.monotonic() - killed_at
    assert got == 2 and "pipeline: stage 'sft' (1 of 2) failed" in text, text[-3000:]
    assert "resume with: " in text and not (out / "dpo").exists(), text[-3000:]
    assert_one_message(text)
    gone, alive = psutil.wait_procs(family, timeout=5)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    print(f"ended {took:.1f} s after the kill")
    assert took < 20, took
    assert stages(out)["sft"]["status"] == "failed"
    rerun(tmp_path, path, out)  # the same command: stage 1 continues from its checkpoint of step 1
    assert json.loads((out / "sft" / "plan.json").read_text())["resume"] is not None
    assert_same_as_uninterrupted(out, reference)


def test_a_stage_named_like_the_pipelines_own_logs_folder_is_refused_before_anything_runs(tmp_path, capsys):
    path, out = write(tmp_path, "stages:\n  - name: logs\n"), tmp_path / "out"
    code, err = in_process(["pipeline", str(path), "--out", str(out)], capsys)
    assert code == 2 and f"stage 'logs' (line 2): the name of the pipeline's own folder {out / 'logs'}" in err, err
    assert not out.exists()


def test_an_edit_the_checkpoint_can_continue_under_is_said_naming_the_stage_and_key(tmp_path, capsys):
    """train resumes a checkpoint under another optimizer.lr (a command line's choice); a pipeline file edited
    between the interruption and the resume command is no command line: the change is said, not made silently."""
    path, out = interrupted_in_stage_1(tmp_path)
    path.write_text(TINY.replace("      optimizer.lr: 1.0e-3\n", "      optimizer.lr: 2.0e-3\n"))
    code, err = in_process(["pipeline", str(path), "--out", str(out)], capsys)
    assert code == 0, err
    assert f"pipeline: stage 'sft' (1 of 2) was started with other settings than {path} now gives it " \
           "(optimizer.lr: 0.001 -> 0.002)" in err, err


@pytest.mark.parametrize("stages_text", ['{"sft": "x"}', '{"sft": {"status": "done", "argv": 5}}',
                                         '{"sft": {"status": ["done"]}}', '{"sft": {"argv": [1, 2]}}'])
def test_a_damaged_state_file_is_one_message_not_a_crash(tmp_path, capsys, stages_text):
    path, out = write(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / "dsrecipes_pipeline.json").write_text('{"dsrecipes_pipeline": 1}')
    (out / STATE_FILE).write_text(f'{{"stages": {stages_text}}}')
    code, err = in_process(["pipeline", str(path), "--out", str(out)], capsys)
    assert code == 2 and f"{out / STATE_FILE} is not a pipeline state this program wrote" in err, err
    assert_one_message(err)
    assert sorted(os.listdir(out)) == [LOCK_FILE, "dsrecipes_pipeline.json", STATE_FILE]  # the lock: ours


@pytest.mark.parametrize("how", ["SIGTERM to the pipeline", "SIGKILL of the pipeline alone"])
def test_the_pipeline_stopped_while_its_ranks_train_leaves_no_process_and_resumes(tmp_path, reference, how):
    """launcher=torchrun: the ranks are child processes. SIGTERM to the pipeline: they checkpoint and stop with it;
    SIGKILL of the pipeline process alone (an OOM killer's choice): its ranks see their launcher gone and stop on their
    own. Either way no process is left, and the same command resumes stage 1 and ends as an uninterrupted run."""
    path, out = write(tmp_path, TORCHRUN), tmp_path / "out"
    proc = start(tmp_path, path, out, fault_env(tmp_path, pause_after_step=1))
    wait_for(proc, out / "sft" / "checkpoints" / "step_1", tmp_path / "first.log", timeout=90)
    family = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGKILL)
    got, text = ended(proc, tmp_path / "first.log")
    gone, alive = psutil.wait_procs(family, timeout=30)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    if how.startswith("SIGTERM"):
        assert got == 143 and "pipeline: stage 'sft' (1 of 2) was interrupted; resume with: " in text, text[-3000:]
        assert "interrupted by SIGTERM (latest checkpoint: " in text, text[-3000:]
    rerun(tmp_path, path, out)
    assert json.loads((out / "sft" / "plan.json").read_text())["resume"] is not None
    assert_same_as_uninterrupted(out, reference)


@pytest.mark.xfail(strict=True, reason="launcher=torchrun: torchrun's own SignalException traceback reaches the "
                   "console on SIGTERM (dsrecipes train alone too; run/launch/, not the pipeline's code)")
def test_sigterm_under_torchrun_says_no_traceback(tmp_path):
    path, out = write(tmp_path, TORCHRUN), tmp_path / "out"
    proc = start(tmp_path, path, out, fault_env(tmp_path, pause_after_step=1))
    wait_for(proc, out / "sft" / "checkpoints" / "step_1", tmp_path / "first.log", timeout=90)
    proc.send_signal(signal.SIGTERM)
    got, text = ended(proc, tmp_path / "first.log")
    assert got == 143
    assert_one_message(text)
