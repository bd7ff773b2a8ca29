"""`dsrecipes pipeline` under hostile conditions, as a sceptic tests it (tests/helpers/pipeline_runs.py: the real
command on the tiny model): `--out` at a directory that is not ours or with a forged marker, a stage directory
someone else wrote, a damaged state file, a stage named like the pipeline's own logs folder (refused, one message,
their files untouched); the pipeline file edited between an interruption and the resume (refused naming the stage
and key, or said where the checkpoint can continue under it); a stage's child process SIGKILLed under
launcher=torchrun (the pipeline ends within seconds naming the stage or the launcher, no process left, the same
command resumes)."""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from dsrecipes.run.pipeline import LOCK_FILE, STATE_FILE
from tests.faults import fault_env
from tests.helpers.pipeline_runs import (
    TINY,
    TORCHRUN,
    Stage1Interrupted,
    assert_one_message,
    assert_same_as_uninterrupted,
    ended,
    in_process,
    rerun,
    stages,
    start,
    wait_for,
    write,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stage_1_interrupted(tmp_path_factory) -> Stage1Interrupted:
    """TINY stopped by SIGTERM in SFT, once: the edit-before-resume tests each start from a fresh copy of it."""
    return Stage1Interrupted(tmp_path_factory.mktemp("stage_1_interrupted"))


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
    assert "Move those files out of it, or start over with a new --out; nothing was changed" in err, err
    assert "Choose another directory" not in err, err  # train's remedy: a stage does not choose its directory
    assert_one_message(err)
    assert os.listdir(out / "sft") == ["mine.txt"] and (out / "sft" / "mine.txt").read_text() == "mine"
    assert not (out / "dpo").exists()

@pytest.mark.parametrize("old, new, key", [
    ("  dataset: {max_samples: 40, val_size: 8}\n", "  dataset: {max_samples: 32, val_size: 8}\n",
     "dataset.max_samples"),
    ("  trainer: {save_every: 1, eval_every: 0, max_steps: 3}\n",
     "  trainer: {save_every: 1, eval_every: 0, max_steps: 3, seed: 7}\n", "trainer.seed"),
])
def test_the_file_edited_before_the_resume_is_refused_naming_the_stage_and_key(stage_1_interrupted, capsys, old, new, key):
    path, out = stage_1_interrupted.fresh()
    path.write_text(TINY.replace(old, new))
    checkpoints = sorted(os.listdir(out / "sft" / "checkpoints"))
    code, err = in_process(["pipeline", str(path), "--out", str(out)], capsys)
    assert code == 2 and "pipeline: stage 'sft' (1 of 2) failed (exit 2)" in err, err
    assert key in err, err
    assert_one_message(err)
    assert sorted(os.listdir(out / "sft" / "checkpoints")) == checkpoints and not (out / "dpo").exists()


@pytest.mark.parametrize("victim", ["rank", "torchrun"])
def test_a_stage_whose_child_is_sigkilled_ends_the_pipeline_in_seconds_leaving_no_process(tmp_path, capfd, pipeline_reference, victim):
    """launcher=torchrun, one rank: torchrun and the rank are child processes of the pipeline; one of them is
    killed (an OOM killer's choice) while the rank holds after step 1. The rank: the pipeline names the stage as
    failed within seconds. torchrun (which starts its ranks in sessions of their own, out of its process group):
    named as the launcher, not as a rank, and its orphaned rank is stopped at the next step boundary with a
    checkpoint (before run/launch/tree.py it was left running, and the run was reported 20 s later as 'a rank was
    killed by SIGKILL (the kernel's OOM killer ...)'). Every process it started is gone, and (the rank's case) the
    same command resumes to the weights and losses of an uninterrupted run."""
    path, out = write(tmp_path, TORCHRUN), tmp_path / "out"
    proc = start(tmp_path, path, out, fault_env(tmp_path, pause_after_step=1))
    wait_for(proc, out / "sft" / "checkpoints" / "step_1", tmp_path / "first.log", timeout=90)
    family = psutil.Process(proc.pid).children(recursive=True)
    agents = [p for p in family if "torch.distributed.run" in p.cmdline()]
    ranks = [p for p in family if "dsrecipes.rank.worker" in p.cmdline() and p not in agents]
    assert len(ranks) == len(agents) == 1, [p.cmdline() for p in family]
    (ranks if victim == "rank" else agents)[0].kill()
    killed_at = time.monotonic()
    got, text = ended(proc, tmp_path / "first.log", within=30)
    took = time.monotonic() - killed_at
    if victim == "rank":
        assert got in (1, 2) and "pipeline: stage 'sft' (1 of 2) failed" in text, text[-3000:]
    else:
        assert got == 143 and "pipeline: stage 'sft' (1 of 2) was interrupted" in text, text[-3000:]
        assert f"the launcher (pid {agents[0].pid}, torch.distributed.run) was killed by SIGKILL while its ranks " \
               "ran; they were stopped at step 2" in text and "a rank was killed" not in text, text[-3000:]
    assert "resume with: " in text and not (out / "dpo").exists(), text[-3000:]
    assert_one_message(text)
    gone, alive = psutil.wait_procs(family, timeout=5)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    print(f"ended {took:.1f} s after the kill")
    assert took < 5, took  # measured: 0.8 s (rank), 1.3 s (torchrun; 20.2 s before tree.py)
    assert stages(out)["sft"]["status"] == ("failed" if victim == "rank" else "interrupted")
    if victim == "torchrun":  # the resume after a killed agent: tests/test_review_launch_tree.py (2 ranks; CI time)
        return
    rerun(tmp_path, path, out, capfd=capfd)  # the same command: stage 1 continues from its last checkpoint
    assert json.loads((out / "sft" / "plan.json").read_text())["resume"] is not None
    assert_same_as_uninterrupted(out, pipeline_reference)


def test_a_stage_named_like_the_pipelines_own_logs_folder_is_refused_before_anything_runs(tmp_path, capsys):
    path, out = write(tmp_path, "stages:\n  - name: logs\n"), tmp_path / "out"
    code, err = in_process(["pipeline", str(path), "--out", str(out)], capsys)
    assert code == 2 and f"stage 'logs' (line 2): the name of the pipeline's own folder {out / 'logs'}" in err, err
    assert not out.exists()


def test_an_edit_the_checkpoint_can_continue_under_is_said_naming_the_stage_and_key(stage_1_interrupted, capsys):
    """train resumes a checkpoint under another optimizer.lr (a command line's choice); a pipeline file edited
    between the interruption and the resume command is no command line: the change is said, not made silently."""
    path, out = stage_1_interrupted.fresh()
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
