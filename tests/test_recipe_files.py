"""Recipe files as users write them: flat YAML without a Hydra header (`dsrecipes train my.yaml`), mistakes located
by file and line, other tools' key names answered with ours, and hostile files (alias bombs, symlink loops,
unreadable files) refused with one message and exit 2 in bounded time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from dsrecipes.cli import main
from tests.conftest import subprocess_env

FLAT = """# My run, written the LLaMA-Factory way: no header, plain keys.
zero: stage2
scheduler: constant
optimizer:
  lr: 3.0e-4
trainer.max_steps: 7
trainer.log_every: 1
"""


def _error(capsys, *argv):
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err.strip()


def _composed(*overrides):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(list(overrides), check_files=False)


def test_a_flat_file_is_a_recipe_group_choices_values_and_dotted_keys(tmp_path, monkeypatch):
    (tmp_path / "my.yaml").write_text(FLAT)
    monkeypatch.chdir(tmp_path)
    cfg = _composed("recipe=my.yaml")
    assert (cfg.zero.stage, cfg.scheduler.name.value, cfg.optimizer.lr) == (2, "constant", 3.0e-4)
    assert (cfg.trainer.max_steps, cfg.trainer.log_every) == (7, 1)
    folder = tmp_path / "team"
    folder.mkdir()
    (folder / "flat_exp.yaml").write_text(FLAT.replace("stage2", "stage3"))
    monkeypatch.setenv("DSRECIPES_RECIPES", str(folder))
    assert _composed("recipe=flat_exp").zero.stage == 3  # by name from a recipe folder, too
    assert _composed("recipe=flat_exp", "zero=stage1").zero.stage == 1  # the command line still wins


def test_a_header_file_keeps_working_and_may_use_flat_group_choices(tmp_path):
    header = tmp_path / "h.yaml"
    header.write_text("# @package _global_\ndefaults:\n  - override /zero: stage2\ntrainer:\n  max_steps: 5\n")
    assert (_composed(f"recipe={header}").zero.stage, _composed(f"recipe={header}").trainer.max_steps) == (2, 5)
    header.write_text("# @package _global_\nzero: stage1\ntrainer.max_steps: 4\n")
    assert (_composed(f"recipe={header}").zero.stage, _composed(f"recipe={header}").trainer.max_steps) == (1, 4)


@pytest.mark.parametrize("text, line, words", [
    ("zero: stage2\noptimizer:\n  lr: 1.0e-3\n  weight_decy: 0.1\n", 4, "optimizer.weight_decy: unknown key; did you mean optimizer.weight_decay?"),
    ("trainer:\n  save_every: 10\n  max_steps: many\n", 3, "trainer.max_steps"),
    ("# note\nzero: stage9\n", 2, "zero=stage9: no option 'stage9' in group 'zero'"),
    ("optimizer:\n  lr: 1.0e-3\nlearning_rate: 3.0e-4\n", 3, "learning_rate: transformers' key (LLaMA-Factory, TRL); here: optimizer.lr: 0.0003"),
    ("trainer:\n  max_steps: 3\n   log_every: 1\n", 3, "not valid YAML"),
    ("- zero: stage2\n", 1, "a recipe is a mapping of keys"),
    ("trainer:\n  experiment: !!python/object/apply:os.system [touch pwned]\n", 2, "not valid YAML: could not "
     "determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'"),  # (not '<file>')
])  # fmt: skip
def test_mistakes_in_a_flat_file_name_the_file_and_line(tmp_path, capsys, text, line, words):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(text)
    err = _error(capsys, "validate", f"recipe={recipe}")
    assert f"{recipe}:{line}" in err and words in err, err


@pytest.mark.parametrize("typed, meant", [
    ("learning_rate=3e-4", "optimizer.lr"), ("+learning_rate=3e-4", "optimizer.lr"), ("max_steps=3", "trainer.max_steps"),
    ("num_train_epochs=2", "trainer.epochs"), ("gradient_accumulation_steps=4", "trainer.grad_accum"),
    ("per_device_train_batch_size=2", "trainer.micro_batch_size"), ("bf16=true", "precision=bf16"),
    ("trainer.learning_rate=1e-4", "optimizer.lr"), ("cutoff_len=512", "data.cutoff_len"),
])  # fmt: skip
def test_top_level_keys_from_elsewhere_suggest_the_full_key(capsys, typed, meant):
    err = _error(capsys, "validate", typed)
    assert f"did you mean {meant}?" in err, err


@pytest.mark.slow
def test_train_takes_a_flat_file_as_a_word_and_runs_it(tmp_path):
    """`dsrecipes train my.yaml`: composed from the file, planned and launched (dry run: the plan and the launch
    line); two files are one message."""
    (tmp_path / "my.yaml").write_text(FLAT + "launcher:\n  dry_run: true\n")
    env = subprocess_env()
    done = subprocess.run([sys.executable, "-m", "dsrecipes", "train", "my.yaml", f"trainer.output_dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["total_steps"] == 7
    assert json.loads((tmp_path / "run" / "result.json").read_text())["status"] == "dry_run"
    assert "stage: 2" in (tmp_path / "run" / "config.yaml").read_text()


def test_two_recipe_words_are_one_message(capsys):
    assert "one recipe file per run" in _error(capsys, "train", "a.yaml", "b.yml")


# ---------------------------------------------------------------------------------------------------------------
# Hostile files: bounded work, one message, exit 2

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))  # 9**9 values


def test_an_alias_bomb_is_refused_in_milliseconds(tmp_path, capsys):
    from dsrecipes.config import recipe_file

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    assert len(BOMB) < 400
    started = time.perf_counter()
    with pytest.raises(Exception, match="expand to more than 100000 values"):
        recipe_file.load(bomb)
    assert time.perf_counter() - started < 1.0
    started = time.perf_counter()
    err = _error(capsys, "validate", f"recipe={bomb}")
    assert f"{bomb}: its YAML aliases" in err and time.perf_counter() - started < 5.0, err
    bomb.write_text("a: &a [1, *a]\n")  # a value that contains itself
    assert "inside the value it names" in _error(capsys, "validate", f"recipe={bomb}")


def test_modest_aliases_are_fine(tmp_path):
    recipe = tmp_path / "ok.yaml"
    recipe.write_text("launcher:\n  env: &env {OMP_NUM_THREADS: '2'}\ntrainer:\n  report_to: &r [tensorboard]\n")
    assert _composed(f"recipe={recipe}").trainer.report_to[0].value == "tensorboard"


def test_symlink_loops_and_unreadable_files_are_messages(tmp_path, capsys, monkeypatch):
    loop, unreadable, folder, binary = tmp_path / "loop.yaml", tmp_path / "mem.yaml", tmp_path / "dir.yaml", tmp_path / "bin.yaml"
    loop.symlink_to(loop)
    unreadable.symlink_to("/proc/self/mem")  # a regular file whose read fails with EIO, for root too
    folder.mkdir()
    binary.write_bytes(b"trainer:\n  max_steps: 3\n\xff\xfe\n")
    assert "a symlink loop" in _error(capsys, "validate", f"recipe={loop}")
    assert "cannot read (Input/output error)" in _error(capsys, "validate", f"recipe={unreadable}")
    assert "a directory; a recipe is a YAML file" in _error(capsys, "validate", f"recipe={folder}")
    assert f"{binary}:3: not UTF-8 text" in _error(capsys, "validate", f"recipe={binary}")
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "looped.yaml").symlink_to(recipes / "looped.yaml")
    monkeypatch.setenv("DSRECIPES_RECIPES", str(recipes))
    assert "a symlink loop" in _error(capsys, "validate", "recipe=looped")  # by name from a recipe folder
    assert main(["ls"]) == 0 and "cannot be read: Too many levels of symbolic links" in capsys.readouterr().out


@pytest.mark.slow
def test_hostile_recipe_files_through_a_run_exit_2_without_a_trace(tmp_path):
    """The run command (a separate process, like a user's): refused before anything is created."""
    (tmp_path / "bomb.yaml").write_text(BOMB)
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    for word, expected in (("bomb.yaml", "its YAML aliases"), ("loop.yaml", "a symlink loop")):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "dsrecipes", "train", word, f"trainer.output_dir={tmp_path / 'run'}"],
                              cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert time.perf_counter() - started < 60 and not (tmp_path / "run").exists()
