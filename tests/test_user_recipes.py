"""User recipes outside the checkout: `recipe=/path/file.yaml` and folders named by DSRECIPES_RECIPES, composed like
shipped recipes (same schema checks, same rules), from any working directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsrecipes.cli import main
from tests.conftest import subprocess_env

RECIPE = """# @package _global_
# My experiment: ZeRO-2, 7 steps.
defaults:
  - override /zero: stage2
trainer:
  max_steps: 7
scheduler:
  warmup_steps: 2
"""


def _write(path, text=RECIPE):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _show(capsys, *overrides):
    assert main(["show", *overrides, "--json-only"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _max_steps(*overrides):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(list(overrides)).trainer.max_steps


def test_recipe_file_by_absolute_relative_and_home_path(tmp_path, capsys, monkeypatch):
    recipe = _write(tmp_path / "exps" / "my_exp.yaml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for value in (str(recipe), "exps/my_exp.yaml", "./exps/my_exp.yaml", "./exps/my_exp", "\"~/exps/my_exp.yaml\""):
        assert _show(capsys, f"recipe={value}")["zero_optimization"]["stage"] == 2, value
        assert _max_steps(f"recipe={value}") == 7, value  # (the LR schedule is ours: no JSON scheduler to read it from)
    yml = _write(tmp_path / "other.yml")
    assert _show(capsys, f"recipe={yml}")["zero_optimization"]["stage"] == 2


def test_recipe_folders_from_the_environment(tmp_path, capsys, monkeypatch):
    first, second = tmp_path / "team", tmp_path / "mine"
    _write(first / "exp.yaml")
    _write(second / "exp.yaml", RECIPE.replace("stage2", "stage3"))  # shadowed by the first folder
    _write(second / "cpu_zero2_two_ranks.yaml", RECIPE.replace("stage2", "stage1"))  # shadows the shipped one
    monkeypatch.setenv("DSRECIPES_RECIPES", f"{first}:{second}")
    monkeypatch.chdir(tmp_path)
    assert _show(capsys, "recipe=exp")["zero_optimization"]["stage"] == 2
    assert _show(capsys, "recipe=cpu_zero2_two_ranks")["zero_optimization"]["stage"] == 1
    assert main(["ls", "recipe"]) == 0
    out = capsys.readouterr().out
    assert "your recipes ($DSRECIPES_RECIPES):" in out and "My experiment: ZeRO-2, 7 steps." in out
    assert str(first / "exp.yaml") in out
    assert main(["validate", "recipe=exq"]) == 2
    assert "did you mean exp?" in capsys.readouterr().err
    monkeypatch.setenv("DSRECIPES_RECIPES", str(tmp_path / "nope"))
    assert main(["validate"]) == 2
    assert "DSRECIPES_RECIPES: not a folder" in capsys.readouterr().err


def test_user_recipes_get_the_schema_and_the_rules(tmp_path, capsys):
    typo = _write(tmp_path / "typo.yaml", "# @package _global_\ntrainer:\n  max_step: 7\n")
    assert main(["validate", f"recipe={typo}"]) == 2
    assert capsys.readouterr().err == f"error: {typo}:3: trainer.max_step: unknown key; did you mean trainer.max_steps?\n"
    rule = _write(tmp_path / "rule.yaml", "# @package _global_\ndefaults:\n  - override /offload: cpu_optimizer\n")
    assert main(["validate", f"recipe={rule}"]) == 2
    assert "offload.optimizer: optimizer offload (cpu) needs ZeRO >= 1" in capsys.readouterr().err
    assert main(["validate", f"recipe={tmp_path / 'missing.yaml'}"]) == 2
    assert f"no such file: {tmp_path / 'missing.yaml'}" in capsys.readouterr().err


def test_a_user_recipe_cannot_name_code(tmp_path, capsys):
    evil = _write(tmp_path / "evil.yaml", "# @package _global_\nhydra:\n  callbacks:\n    evil:\n"
                                          "      _target_: os.getcwd\n")
    assert main(["validate", f"recipe={evil}"]) == 2
    assert f"set by {evil.resolve()}" in capsys.readouterr().err  # (every route: test_safety.py)


@pytest.mark.slow
def test_a_sweep_over_recipe_files_from_a_foreign_directory(tmp_path):
    a = _write(tmp_path / "a.yaml")
    b = _write(tmp_path / "b.yaml", RECIPE.replace("stage2", "stage1"))
    sweep = tmp_path / "sweep"
    out = subprocess.run([sys.executable, "-m", "dsrecipes", "-m", f"recipe={a},{b}", "launcher.dry_run=true",
                          f"hydra.sweep.dir={sweep}", f"data.cache_dir={tmp_path / 'cache'}"],
                         cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = json.loads((sweep / "summary.json").read_text())["jobs"]
    assert [j["overrides"][0] for j in jobs] == [f"recipe={a}", f"recipe={b}"]
    stages = [json.loads((sweep / j["job"] / "ds_config.json").read_text())["zero_optimization"]["stage"] for j in jobs]
    assert stages == [2, 1]
