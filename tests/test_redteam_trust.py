"""Red-team of the trust boundary (a shared recipe, pipeline file, model directory or checkpoint handed over by
someone else), each attack tried for real through the CLI: what was still open after the earlier rounds."""

from __future__ import annotations

import pytest

from dsrecipes.cli import main as cli_main


@pytest.mark.parametrize("value", ["${trainer.experiment}", "${now:/tmp/dsr-elsewhere-run}", "${dsr.asset:run}"])
def test_a_shared_recipes_run_directory_cannot_reach_outside_through_an_interpolation(value, tmp_path, monkeypatch,
                                                                                       capsys):
    # Was: trainer.output_dir was judged on its text, relative and without '..', so the run (config.yaml,
    # checkpoints, the export) was written to /tmp/dsr-elsewhere-run or into the installed package.
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f"trainer:\n  experiment: /tmp/dsr-elsewhere-run\n  output_dir: '{value}'\n", encoding="utf-8")
    assert cli_main(["validate", f"recipe={recipe}", "debug=fast"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"trainer.output_dir: set by {recipe}:3, a shared recipe" in err, err
    assert "Traceback" not in err


def test_a_shared_recipes_interpolated_run_directory_inside_the_working_one_is_accepted(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text("trainer:\n  experiment: abc\n  output_dir: runs/${now:%H}/${trainer.experiment}\n",
                      encoding="utf-8")
    assert cli_main(["validate", f"recipe={recipe}", "debug=fast"]) == 0, capsys.readouterr().err
