"""`dsrecipes pipeline FILE`: stages in order, each a run directory, the next one's model from an earlier export.

Hostile: a pipeline file with an unknown key, a `_target_` or a shell string in a value is refused with its
file:line before anything runs; a stage that fails stops the pipeline naming the stage and the resume command
(exit 2) and the later stages do not run; the same command after a kill (mid-stage: SIGKILL of the whole process
group while the second stage trains; between stages: the run finished but its record was not written) never runs a
finished stage again and resumes the interrupted one from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsrecipes.config.pipeline_file import load_pipeline, stage_overrides
from dsrecipes.core.errors import ConfigError, UserError
from dsrecipes.core.locks import ExclusiveLock
from dsrecipes.run.pipeline import LOCK_FILE, STATE_FILE, run_pipeline, stage_argv
from tests.conftest import REPO, in_process_environ, subprocess_env
from tests.faults import fault_env

TINY = """\
prompts: {limit: 2, max_new_tokens: 4}
shared:
  debug: fast
  data.cutoff_len: 512
  dataset: {max_samples: 40, val_size: 8}
  trainer: {save_every: 1, eval_every: 0, max_steps: 2}
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


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("bad, line, says", [
    ("stages:\n  - name: a\n    colour: red\n", 3, "stages[0]: unknown key 'colour'"),
    ("shared:\n  model: {_target_: os.system}\nstages:\n  - name: a\n", 2, "Hydra's _target_"),
    ("stages:\n  - name: a\n    set:\n      _target_: os.system\n", 4, "Hydra's _target_"),
    ("stages:\n  - name: a\n    set:\n      dataset.name: x; rm -rf ~\n", 4, "';' is not allowed in a value"),
    ("stages:\n  - name: a\n    set:\n      template.default_system: $(curl x | sh)\n", 4, "'$' is not allowed"),
    ("stages:\n  - name: a\n    set:\n      trainer.output_dir: /etc\n", 4, "set by the pipeline"),
    ("stages:\n  - name: a\n  - name: b\n    model_from: c\n", 4, "'c' is not an earlier stage"),
    ("stages:\n  - name: a\n    set: {trainer.max_stepz: 3}\n", 3, "did you mean trainer.max_steps?"),
    ("stages:\n  - name: a\n    from_export: {model.tokenizer_path: b}\n  - name: b\n", 3, "not an earlier stage"),
    ("stages:\n  - name: a\n  - name: b\n    from_export: {model.path: a}\n", 4, "set by the pipeline"),
    ("stages:\n  - name: a\n    set: {objective: dpx}\n", 3, "'dpx' is not an option of objective"),
    ("stages:\n  - name: a\n  - name: a\n", 3, "'a' names an earlier stage too"),
    ("stages: []\nextra: 1\n", 1, "stages: a non-empty list"),
])
def test_a_pipeline_file_is_data_refused_with_file_and_line(tmp_path, bad, line, says):
    path = write(tmp_path, bad)
    with pytest.raises(ConfigError) as err:
        load_pipeline(path)
    assert any(p.startswith(f"{path}:{line}: ") and says in p for p in err.value.problems), err.value.problems


def test_settings_become_overrides_train_checks_again(tmp_path):
    pipeline = load_pipeline(write(tmp_path, TINY))
    dpo = pipeline.stage("dpo")
    assert stage_overrides(pipeline, dpo)[-5:] == [
        "objective=dpo", "dataset=sample_pairs", "++dataset.split.shares={reward:1,dpo:1}",
        "dataset.split.take=dpo", "trainer.max_steps=6"]
    assert f"model.path={(tmp_path / 'out').resolve()}/sft/export" in stage_argv(pipeline, dpo, tmp_path / "out")
    rl = load_pipeline(write(tmp_path, THREE.replace("model_from: b", "from_export: {model.tokenizer_path: a}")))
    assert f"model.tokenizer_path={(tmp_path / 'out').resolve()}/a/export" in stage_argv(rl, rl.stage("c"), tmp_path / "out")


class FakeTrain:
    """Records the stages `train` was asked to run; `fail`/`interrupt` name stages that fail or are killed."""

    def __init__(self, fail=(), interrupt=()):
        self.calls, self.fail, self.interrupt = [], set(fail), set(interrupt)

    def __call__(self, argv):
        run_dir = Path(next(a for a in argv if a.startswith("trainer.output_dir=")).partition("=")[2])
        self.calls.append(run_dir.name)
        if run_dir.name in self.interrupt:
            raise KeyboardInterrupt
        if run_dir.name in self.fail:
            return 1
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "result.json").write_text(json.dumps({"status": "ok", "exit_code": 0}))
        return 0


THREE = "stages:\n  - name: a\n  - name: b\n    model_from: a\n  - name: c\n    model_from: b\n"


def test_a_failing_stage_stops_the_pipeline_naming_it_and_the_resume_command(tmp_path):
    pipeline, out, train = load_pipeline(write(tmp_path, THREE)), tmp_path / "out", FakeTrain(fail={"b"})
    with pytest.raises(UserError) as err:
        run_pipeline(pipeline, out, train, "dsrecipes pipeline p.yaml --out out")
    assert err.value.exit_code == 2 and train.calls == ["a", "b"]
    assert "stage 'b' (2 of 3) failed (exit 1)" in err.value.problems[0]
    assert err.value.problems[0].endswith("resume with: dsrecipes pipeline p.yaml --out out")
    state = json.loads((out / STATE_FILE).read_text())["stages"]
    assert state["a"]["status"] == "done" and state["b"]["status"] == "failed" and "c" not in state
    with ExclusiveLock(out / LOCK_FILE):  # one pipeline at a time in a directory
        with pytest.raises(UserError, match="is in use by another pipeline"):
            run_pipeline(pipeline, out, train, "")
    train.fail.clear()  # fixed: the same command goes on at b, never at a
    assert run_pipeline(pipeline, out, train, "") == 0 and train.calls == ["a", "b", "b", "c"]


def test_resume_never_reruns_a_finished_stage(tmp_path):
    pipeline, out = load_pipeline(write(tmp_path, THREE)), tmp_path / "out"
    train = FakeTrain(interrupt={"b"})
    with pytest.raises(KeyboardInterrupt):  # killed mid-stage b
        run_pipeline(pipeline, out, train, "")
    assert json.loads((out / STATE_FILE).read_text())["stages"]["b"]["status"] == "interrupted"
    train.interrupt.clear()
    state = json.loads((out / STATE_FILE).read_text())
    state["stages"]["b"]["status"] = "running"  # killed between stages: b's run ended, its record was not written
    (out / STATE_FILE).write_text(json.dumps(state))
    FakeTrain()(stage_argv(pipeline, pipeline.stage("b"), out))  # b's run finished (its result.json says ok)
    assert run_pipeline(pipeline, out, train, "") == 0
    assert train.calls == ["a", "b", "c"]  # a and b are never run again
    (tmp_path / "p.yaml").write_text(THREE.replace("  - name: b\n", "  - name: b\n    set: {optimizer.lr: 0.1}\n"))
    with pytest.raises(UserError, match="stage 'b' \\(2 of 3\\) finished with other settings"):
        run_pipeline(load_pipeline(tmp_path / "p.yaml"), out, train, "")


def test_a_stage_refused_by_train_stops_the_cli_with_exit_2(tmp_path, capsys):
    from dsrecipes.cli import main

    path = write(tmp_path, "stages:\n  - name: sft\n    set: {dataset.paths: [missing.jsonl]}\n  - name: b\n")
    code = main(["pipeline", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr()
    assert code == 2 and "pipeline: stage 'sft' (1 of 2) failed (exit 2)" in err.err, err
    command = f"cd {os.getcwd()} && {sys.executable} -m dsrecipes pipeline {path} --out {tmp_path / 'out'}"
    assert f"resume with: {command}" in err.err
    assert not (tmp_path / "out" / "b").exists()


@pytest.mark.slow
def test_tiny_sft_then_dpo_killed_mid_stage_resumes_without_rerunning_sft(tmp_path):
    """The real thing on the tiny model: SIGKILL of the pipeline's process group while DPO trains (its third
    checkpoint written, then held there: tests/faults.py stall_after_step, so the kill never races the stage's end
    under load), then the same command: SFT is not run again, DPO resumes from its checkpoint, on the SFT export,
    reading only its share of the pairs; the summary compares the stages."""
    from dsrecipes.cli import main

    path, out = write(tmp_path, TINY), tmp_path / "out"
    cmd = [sys.executable, "-m", "dsrecipes", "pipeline", str(path), "--out", str(out)]
    log = tmp_path / "first.log"
    held = fault_env(tmp_path, stall_after_step=3)["PYTHONPATH"]  # SFT has 2 steps: only DPO is held
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=subprocess_env({"PYTHONPATH": held + os.pathsep + str(REPO)}),
                                start_new_session=True, stdout=fh, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while not (out / "dpo" / "checkpoints" / "step_3").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert not (out / "dpo" / "checkpoints" / "step_4").exists()  # held at step 3 until the kill
    sft_result = (out / "sft" / "result.json").stat().st_mtime_ns
    with in_process_environ():
        assert main(["pipeline", str(path), "--out", str(out)]) == 0
    assert (out / "sft" / "result.json").stat().st_mtime_ns == sft_result
    plan = json.loads((out / "dpo" / "plan.json").read_text())
    assert plan["resume"] is not None, plan
    config = (out / "dpo" / "config.yaml").read_text()
    assert f"path: {out.resolve()}/sft/export" in config
    stats = json.loads((out / "dpo" / "prepare_stats.json").read_text())
    assert stats["rows_read"] == 40  # the cap, reached within the dpo share (the file holds 1681 pairs)
    state = json.loads((out / STATE_FILE).read_text())["stages"]
    assert [state[s]["status"] for s in ("sft", "dpo")] == ["done", "done"]
    assert (out / "pipeline_summary.png").is_file() and "| dpo | dpo | 6 |" in (out / "pipeline_summary.md").read_text()
    answers = (out / "pipeline_prompts.md").read_text()  # base, SFT and DPO on the same two held-out prompts
    assert answers.count("- **base**:") == answers.count("- **sft**:") == answers.count("- **dpo**:") == 2, answers


def test_the_shipped_pipelines_load_and_every_stage_validates(tmp_path):
    from dsrecipes.run.pipeline import check_stages

    files = sorted((REPO / "recipes" / "pipelines").glob("*.yaml"))
    assert files
    for path in files:
        pipeline = load_pipeline(path)
        check_stages(pipeline, tmp_path / path.stem)  # composes and validates each stage (files checked at its start)
        assert not (tmp_path / path.stem).exists()


TINY_GRPO = """\
shared:
  debug: fast
  data.cutoff_len: 256
  dataset: {max_samples: 24, val_size: 0}
  trainer: {save_every: 0, eval_every: 0, max_steps: 1, micro_batch_size: 2, log_every: 1}
stages:
  - name: sft
  - name: reward
    model_from: sft
    set:
      objective: reward
      dataset: sample_pairs
      dataset.split.shares: {reward: 1, rl: 1}
      dataset.split.take: reward
  - name: grpo
    model_from: sft
    from_export: {objective.reward_model: reward}
    set:
      objective: grpo
      dataset.paths:
        - ${dsr.asset:sample_data}/pairs.jsonl
      dataset.split.shares: {reward: 1, rl: 1}
      dataset.split.take: rl
      objective.rewards: [{name: length, max_chars: 40, weight: 0.5}]
      objective.num_generations: 2
      objective.max_completion_length: 8
      trainer.max_steps: 2
      trainer.export: false
"""


@pytest.mark.slow
def test_tiny_pipeline_ends_with_grpo_on_the_sft_export_scored_by_the_reward_export(tmp_path):
    """SFT -> reward -> grpo on the tiny model (as recipes/pipelines/smollm2_chat_grpo.yaml on SmolLM2): the grpo
    stage samples with the SFT export (model.path) and is scored by the reward stage's export
    (objective.reward_model) plus the `length` check, on the other share of the pairs file read as prompts."""
    from dsrecipes.cli import main

    path, out = write(tmp_path, TINY_GRPO), tmp_path / "out"
    with in_process_environ():
        assert main(["pipeline", str(path), "--out", str(out)]) == 0
    state = json.loads((out / STATE_FILE).read_text())["stages"]
    assert [state[s]["status"] for s in ("sft", "reward", "grpo")] == ["done"] * 3
    config = (out / "grpo" / "config.yaml").read_text()
    assert f"path: {out.resolve()}/sft/export" in config and f"reward_model: {out.resolve()}/reward/export" in config
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all("reward_reward_model" in r and "reward_length" in r for r in steps)
