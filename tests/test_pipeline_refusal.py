"""A pipeline stage whose run is refused on resume (its settings differ from its checkpoint's) says the pipeline's
remedy, not train's: a stage's trainer.output_dir is the pipeline's, so "start a new run in another
trainer.output_dir" would be advice the user cannot follow. Real tiny pipeline (SFT, then DPO), its DPO stage made
unfinished as a kill leaves it, the pipeline file's DPO settings then changed to a seed its checkpoint was not
trained with; and the same through a stand-in train whose refusal is raised by run/resume_contract.check (under
the pipeline's remedy, run/pipeline.remedies), where the file is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.config.pipeline_file import load_pipeline
from dsrecipes.core.errors import UserError
from dsrecipes.run import resume_contract
from dsrecipes.run.pipeline import STATE_FILE, StageFailed, run_pipeline
from tests.conftest import in_process_environ

PIPELINE = """\
shared:
  debug: fast
  data.cutoff_len: 256
  dataset: {max_samples: 16, val_size: 0}
  trainer: {save_every: 1, eval_every: 0, max_steps: 2, micro_batch_size: 2}
stages:
  - name: sft
  - name: dpo
    model_from: sft
    set:
      objective: dpo
      dataset: sample_pairs
      trainer.export: false
"""


def test_a_stage_refused_on_resume_says_the_pipelines_remedy(tmp_path, capsys):
    from dsrecipes.cli import main

    path, out = tmp_path / "p.yaml", tmp_path / "out"
    path.write_text(PIPELINE)
    with in_process_environ():
        assert main(["pipeline", str(path), "--out", str(out)]) == 0
    state = json.loads((out / STATE_FILE).read_text())
    state["stages"]["dpo"]["status"] = "interrupted"  # killed after its last checkpoint, before its result
    (out / STATE_FILE).write_text(json.dumps(state))
    (out / "dpo" / "result.json").unlink()
    path.write_text(PIPELINE.replace("      trainer.export: false\n", "      trainer.export: false\n      trainer.seed: 7\n"))
    capsys.readouterr()
    with in_process_environ():
        assert main(["pipeline", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pipeline: stage 'dpo' (2 of 2) failed (exit 2): cannot resume " in err, err
    assert "trainer.seed: 42 -> 7" in err, err
    assert f"it was started with other settings (trainer.seed: - -> 7): restore them in {path}, or start over " \
           "with a new --out" in err, err
    assert "another trainer.output_dir" not in err, err


def test_a_refusal_without_a_changed_file_still_gets_the_pipelines_remedy(tmp_path):
    """The pipeline file is as the stage started, yet train refuses (e.g. a default changed under it): the remedy
    is still the pipeline's."""
    path = tmp_path / "p.yaml"
    path.write_text("stages:\n  - name: a\n")

    def train(argv):
        try:
            resume_contract.check({"trainer": {"seed": 1}}, {"trainer": {"seed": 2}}, "a", "a",
                                  "out/a/checkpoints/step_2")
        except UserError as exc:
            raise StageFailed(exc.exit_code, [f"error: {p}" for p in exc.problems]) from None

    with pytest.raises(UserError) as err:
        run_pipeline(load_pipeline(path), tmp_path / "out", train, "dsrecipes pipeline p.yaml --out out")
    said = err.value.problems[0]
    assert "another trainer.output_dir" not in said and "trainer.seed: 1 -> 2\n(nothing was changed)" in said, said
    assert f"; restore the stage's settings in {Path(path)}, or start over with a new --out" in said, said
