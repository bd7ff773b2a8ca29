"""A sceptical user's inputs, each one message naming the key, flag or file:line, exit 2, no traceback, nothing
written: a NaN or infinite number in any config field (was: `optimizer.lr=nan` passed validation and failed in the
rank with a TypeError, exit 1; `dataset.val_size=inf` was an OverflowError traceback), `shard --val-size inf|nan`
(traceback / a shard written), `audit --num-rows` past what fits in memory (numpy's MemoryError traceback) and
`audit --ledger` on a directory with no ledger (exit 1, a "violation"), a run's config.yaml that is not YAML (a
yaml traceback from `export`/`prompt-eval`), an empty pipeline file (AttributeError traceback), and `score` on a
model with two labels (refused only after transformers loaded it and printed its load report), `train
--trust-checkpoint` without a path and a Ctrl-C while a command's modules import (tracebacks: both ran before
cli.py's guard), and a recipe whose defaults list names another recipe (`override /recipe: X`
was silently ignored, `/recipe: X` reported a cycle that was not there); a Ctrl-C that Python swallows in a
finalizer, and one while export imports DeepSpeed (it left an empty staging directory); `ls recipe` waiting forever on
a FIFO in the user's recipe folder, a FIFO or directory given as launcher.hostfile or dataset.registry, and whole
numbers past 64 bits (data.cutoff_len=10^20: a numpy traceback), an empty flag value taken as the default
(`export --tag ""` exported the newest checkpoint, `pipeline --out ""` ran into runs/NAME).
All in this process through `dsrecipes.cli.main`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

from dsrecipes.cli import main as cli_main
from dsrecipes.config.load import load_run_config
from dsrecipes.core.errors import ConfigError
from tests.conftest import in_process_environ


def refused(capsys, argv: List[str], *needles: str, one_line: bool = False) -> str:
    """`dsrecipes ARGV` (in this process, its environment restored after) exits 2 with one `error:` line, first,
    holding every needle, and no traceback; `one_line`: stderr is that line alone. Returns stderr. The one helper of
    the message tests (test_cli_flags_hostile, test_messages_terminal, test_trust_redteam use it)."""
    with in_process_environ():
        code = cli_main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert err.startswith("error: ") and len(errors) == 1 and "Traceback" not in err, err
    assert not one_line or err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


@pytest.mark.parametrize("override, key, shown", [
    ("optimizer.lr=nan", "optimizer.lr", "nan"),
    ("dataset.val_size=inf", "dataset.val_size", "inf"),
    ("trainer.stop_grace_s=inf", "trainer.stop_grace_s", "inf"),
    ("optimizer.betas=[0.9,nan]", "optimizer.betas[1]", "nan"),
])
def test_a_non_finite_number_is_refused_naming_its_key(capsys, override, key, shown):
    err = refused(capsys, ["validate", override], f"{key}: must be a finite number, got {shown}")
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_shard_val_size_must_be_a_finite_count_or_fraction(capsys, tmp_path, value):
    out = tmp_path / "parts"
    refused(capsys, ["shard", "--parts", "2", "--out", str(out), "--val-size", value], "--val-size", repr(value))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_audit_refuses_rows_it_cannot_hold_and_a_directory_without_a_ledger(capsys, tmp_path):
    refused(capsys, ["audit", "--num-rows", "999999999999"], "--num-rows", "up to 100000000")
    refused(capsys, ["audit", "--num-rows", "100000000", "--epochs", "1000"], "--num-rows", "--epochs")
    refused(capsys, ["audit", "--ledger", str(tmp_path)], "--ledger", str(tmp_path), "record_samples")


@pytest.mark.parametrize("text, where", [
    ("data:\n  kind: [\n", "config.yaml:3: not valid YAML"),
    ("- 1\n", "holds a list"),
    (b"a: \xff\n", "not UTF-8"),
])
def test_a_damaged_run_config_names_its_file(tmp_path, text, where):
    path = tmp_path / "config.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=where) as info:
        load_run_config(tmp_path)
    assert str(path) in str(info.value)


def test_an_empty_pipeline_file_is_one_message(capsys, tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    refused(capsys, ["pipeline", str(empty), "--out", str(tmp_path / "out")], f"{empty}:1:", "stages: missing")
    assert not (tmp_path / "out").exists()


def test_score_refuses_a_model_with_two_labels_before_loading_it(capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))  # transformers' default: 2 labels
    (model / "model.safetensors").write_bytes(b"")  # never read: refused before loading
    pairs = Path(__file__).parents[1] / "dsrecipes/assets/sample_data/pairs.jsonl"
    out = tmp_path / "rewards.jsonl"
    err = refused(capsys, ["score", str(model), "--pairs", str(pairs), "--out", str(out)], "has 2", "config.json")
    assert "LOAD REPORT" not in err and not out.exists()


def test_train_trust_flag_without_a_path_is_one_message(capsys):
    """`dsrecipes train --trust-checkpoint` (no PATH): a UserError raised while routing, before the guard (was a
    traceback, exit 1)."""
    refused(capsys, ["train", "--trust-checkpoint"], "--trust-checkpoint needs the checkpoint")
    refused(capsys, ["--trust-checkpoint"], "--trust-checkpoint needs the checkpoint")


def test_ctrl_c_while_a_command_imports_is_interrupted_not_a_traceback(capsys, monkeypatch):
    """A Ctrl-C in the seconds `train` spends importing Hydra and torch (was: KeyboardInterrupt traceback, exit 1)."""
    import dsrecipes.cli as cli

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli_main(["validate"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("header, entry", [
    ("", "override /recipe: {leaf}"),  # was: silently ignored (trainer.max_steps stayed 400), exit 0
    ("# @package _global_\n", "override /recipe: cpu_zero2_two_ranks"),  # was: ignored, zero=0 launcher=local
    ("", "/recipe: {leaf}"),  # was: "the defaults lists include each other in a cycle" (there is none)
])
def test_a_recipe_that_includes_another_recipe_names_the_entry(capsys, tmp_path, header, entry):
    leaf = tmp_path / "leaf.yaml"
    leaf.write_text("trainer.max_steps: 3\n")
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"{header}defaults:\n  - {entry.format(leaf=leaf)}\n  - _self_\n")
    line = header.count("\n") + 1
    err = refused(capsys, ["validate", f"recipe={mine}"], f"{mine}:{line}: defaults: recipe ",
                  "cannot include another recipe")
    assert "cycle" not in err and err.count("\n") == 1, err


def test_a_cache_dir_that_cannot_be_made_is_one_message(capsys, tmp_path):
    """data.cache_dir naming a file: `inspect-data` and `audit` (which skip train's preflight) were a
    NotADirectoryError traceback from the cache's mkdir; as root, /proc/x passed every os.access check the same way."""
    rows = tmp_path / "rows.jsonl"
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    rows.write_text(json.dumps(row) + "\n")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("mine\n")
    refused(capsys, ["inspect-data", f"data.cache_dir={blocker}", f"dataset.paths=[{rows}]", "dataset.val_size=0"],
            "data.cache_dir: cannot create", str(blocker))
    assert blocker.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["not_a_dir", "rows.jsonl"]


@pytest.mark.parametrize("argv, flag", [
    (["export", "{tmp}", "--tag", "", "--out", "{tmp}/out"], "--tag"),  # exported the newest checkpoint, exit 0
    (["pipeline", "{tmp}/p.yaml", "--out", ""], "--out"),  # ran into the default runs/p
    (["inspect-data", "--run-dir", ""], "--run-dir"),  # a temporary directory instead
    (["shard", "--parts", "2", "--out", ""], "--out"),  # the working directory
])
def test_an_empty_flag_value_is_refused_not_taken_as_the_default(capsys, tmp_path, argv, flag):
    """`--out "$DIR"` with DIR unset: every flag but chat's free text refuses an empty value."""
    (tmp_path / "p.yaml").write_text("stages:\n  - name: a\n")
    refused(capsys, [a.format(tmp=tmp_path) for a in argv], f"{flag}: empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]


def test_an_interrupt_python_swallows_in_a_finalizer_still_stops_the_command(capsys):
    """A Ctrl-C that lands in a `__del__` (regex's Group.__del__ while transformers imports, ~0.2 s of `export`)
    was printed as 'Exception ignored in ... KeyboardInterrupt' and the command went on to exit 0."""
    import time

    from dsrecipes.cli import run_guarded

    class Finalizer:
        def __del__(self):
            raise KeyboardInterrupt

    def command(argv):
        Finalizer()  # collected at once: its KeyboardInterrupt is Python's "unraisable"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.005)
        return 0

    started = time.monotonic()
    assert run_guarded(command, []) == 130
    assert capsys.readouterr().err == "interrupted\n" and time.monotonic() - started < 1


def test_export_leaves_no_staging_directory_when_interrupted_or_refused(tmp_path, monkeypatch):
    """A Ctrl-C while export imports DeepSpeed left an empty `.OUT.tmp-*` beside --out; a staging directory the
    filesystem refuses (/proc/x as root passes check_out_dir's os.access) was a FileNotFoundError traceback."""
    import dsrecipes.rank.export as export
    from dsrecipes.core.errors import UserError

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "load_deepspeed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export._save_hf(None, None, tmp_path / "out", {}, "--out")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(export, "load_deepspeed", lambda: None)

    def refused(target, tag="tmp"):
        raise FileNotFoundError(2, "No such file or directory", str(target))

    monkeypatch.setattr(export, "staging_dir", refused)
    with pytest.raises(UserError, match=r"--out: cannot create .*out \(No such file or directory\)"):
        export._save_hf(None, None, tmp_path / "out", {}, "--out")


@pytest.mark.timeout(30)
def test_ls_does_not_wait_on_a_fifo_in_the_users_recipe_folder(capsys, tmp_path, monkeypatch):
    """`dsrecipes ls recipe` with a FIFO named *.yaml in $DSRECIPES_RECIPES waited forever for a writer."""
    import os

    (tmp_path / "good.yaml").write_text("# My experiment.\ntrainer.max_steps: 3\n")
    os.mkfifo(tmp_path / "pipe.yaml")
    monkeypatch.setenv("DSRECIPES_RECIPES", str(tmp_path))
    assert cli_main(["ls", "recipe"]) == 0
    out = capsys.readouterr().out
    assert "My experiment." in out and "(not a regular file, so not a recipe)" in out


@pytest.mark.parametrize("key, extra", [("launcher.hostfile", ["launcher=deepspeed_multinode"]),
                                        ("dataset.registry", ["dataset.use=[x]"])])
def test_a_fifo_or_directory_where_a_file_is_read_is_refused(capsys, tmp_path, key, extra):
    """A FIFO hostfile passed validate (the hostfile check looked at regular files only): its reader would block."""
    import os

    fifo = tmp_path / "named.fifo"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        folder = key == "dataset.registry" and path == tmp_path  # LLaMA-Factory's dataset_dir: told the file to name
        words = f"is a folder; name the registry file in it: {key}={path}/dataset_info.json" if folder else \
            "is not a regular file"
        refused(capsys, ["validate", f"{key}={path}", *extra], f"{key}: '{path}' {words}")


@pytest.mark.parametrize("override, needle", [
    ("data.cutoff_len=99999999999999999999", "data.cutoff_len: 99999999999999999999 does not fit in 64 bits"),
    ("trainer.max_steps=99999999999999999999999", "trainer.max_steps: 99999999999999999999999 does not fit"),
    ("data.cutoff_len=1099511627776", "data.cutoff_len: must be from 8 to 16777216 tokens"),
])
def test_a_whole_number_past_what_is_counted_is_refused(capsys, override, needle):
    """data.cutoff_len=10^20 passed validate and was a numpy casting traceback in data preparation;
    trainer.max_steps=10^23 trained 'forever' (eta 5e18 h)."""
    refused(capsys, ["validate", override], needle)
