"""A LLaMA-Factory user's first day, second pass (played on a CPU machine from a scratch directory): what they typed,
following the README and the migration messages literally, and what it answered."""

from __future__ import annotations

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
