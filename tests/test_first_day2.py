"""A LLaMA-Factory user's first day, second pass (played on a CPU machine from a scratch directory): what they typed,
following the README and the migration messages literally, and what it answered."""

from __future__ import annotations

import pytest

from dsrecipes.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out + captured.err


def test_the_epochs_migration_message_written_into_a_recipe_file_is_accepted(tmp_path, capsys):
    """`num_train_epochs: 3` answers 'here: trainer.epochs: 3 with trainer.max_steps: null'; written into the file as
    said, `trainer.max_steps: null` was refused ('must not be null (expected int)') though the command line's
    trainer.max_steps=null and conf/trainer/full_epochs.yaml take it. A non-Optional key's null is still refused."""
    recipe = tmp_path / "lf.yaml"
    recipe.write_text("num_train_epochs: 3.0\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 2 and "trainer.epochs: 3 with trainer.max_steps: null" in said, said
    recipe.write_text("trainer.epochs: 3\ntrainer.max_steps: null\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 0, said
    recipe.write_text("trainer:\n  epochs: 3\n  max_steps: null\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 0, said
    recipe.write_text("trainer.micro_batch_size: null\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 2 and "trainer.micro_batch_size: must not be null" in said, said


def test_a_finished_epoch_based_run_is_told_to_raise_its_epochs():
    """A finished `trainer.max_steps: null, trainer.epochs: 3` run (LLaMA-Factory's num_train_epochs) resumed with the
    same budget was told 'raise trainer.max_steps above 81 (e.g. trainer.max_steps=162)': a key the user never wrote,
    which turns the run from epochs into steps. Now it names trainer.epochs first (tried: trainer.epochs=4 resumes at
    step 81 and trains epoch 4); a step-budget run keeps the step advice."""
    from dsrecipes.core.errors import Refused
    from dsrecipes.run.resume_contract import check_budget

    epochs = {"trainer": {"max_steps": None, "epochs": 3}}
    with pytest.raises(Refused) as refused:
        check_budget("step_81", 81, 81, {}, epochs, epochs, finished=True)
    assert "raise trainer.epochs above 3 (e.g. trainer.epochs=6), or set trainer.max_steps above 81" in str(
        refused.value), refused.value
    steps = {"trainer": {"max_steps": 400, "epochs": 1}}
    with pytest.raises(Refused) as refused:
        check_budget("step_400", 400, 400, {}, steps, steps, finished=True)
    assert "raise trainer.max_steps above 400 (e.g. trainer.max_steps=800)" in str(refused.value), refused.value
