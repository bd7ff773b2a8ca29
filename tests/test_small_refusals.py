"""Issue 50's medium/low findings, each one message (exit 2) or a safe output: a recipe that includes itself names the
cycle (was "maximum recursion depth exceeded"); the signing key is refused through a symlink or from a directory
others can write; `inspect-data --color never` shows control characters from data rows escaped (a row could
drive the terminal); `prompt-eval`/`chat --max-new-tokens` and `audit --world-size/--epochs` are bounded."""

from __future__ import annotations

import json
import os
import time

import pytest

from dsrecipes.boundary import trust
from dsrecipes.cli import main as cli_main
from dsrecipes.core.errors import UserError


def test_a_recipe_including_itself_names_the_cycle(tmp_path, capsys):
    me = tmp_path / "me.yaml"
    me.write_text(f"defaults:\n  - /recipe: {me}\n  - _self_\ntrainer.max_steps: 3\n")
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(f"defaults:\n  - /recipe: {b}\n")
    b.write_text(f"# @package _global_\ndefaults:\n  - override /recipe: {a}\n")
    for recipe, cycle in ((me, f"{me} -> {me}"), (a, f"{a} -> {b} -> {a}")):
        assert cli_main(["validate", f"recipe={recipe}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: recipe: the recipes include each other in a cycle: ") and cycle in err, err
        assert "recursion" not in err and "Traceback" not in err and err.count("\n") == 1


def test_the_signing_key_through_a_symlink_is_refused(tmp_path, monkeypatch):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv(trust.KEY_ENV, str(private / "checkpoint.key"))
    trust.ensure_key()  # a key in a private directory: fine
    link = private / "link.key"
    link.symlink_to(private / "checkpoint.key")
    monkeypatch.setenv(trust.KEY_ENV, str(link))
    with pytest.raises(UserError, match="is a symlink"):
        trust.sign({"step": 1})
    dangling = private / "dangling.key"
    dangling.symlink_to(tmp_path / "somewhere_else.key")
    monkeypatch.setenv(trust.KEY_ENV, str(dangling))
    with pytest.raises(UserError, match="is a symlink"):
        trust.ensure_key()
    assert not (tmp_path / "somewhere_else.key").exists()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_the_signing_key_in_a_directory_others_write_is_refused(tmp_path, monkeypatch, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv(trust.KEY_ENV, str(shared / "checkpoint.key"))
    trust.ensure_key()
    os.chmod(shared, mode)
    with pytest.raises(UserError, match="a directory others can write") as caught:
        trust.sign({"step": 1})
    assert str(caught.value).count("\n") == 0
    os.unlink(shared / "checkpoint.key")
    with pytest.raises(UserError, match="a directory others can write"):
        trust.ensure_key()  # nor is a new one made there
    assert not (shared / "checkpoint.key").exists()


def test_inspect_data_never_prints_escape_sequences_from_rows(tmp_path, capsys):
    data = tmp_path / "evil.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"hi \x1b]0;pwned\x07 {i}"},
                               {"from": "gpt", "value": "\x1b[2J\x1b[31mred\x9b answer"}]} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["inspect-data", f"dataset.paths=[{data}]", f"data.cache_dir={tmp_path / 'cache'}", "dataset.val_size=0",
            "--rows", "2", "--color", "never", "--split", "train"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert "\\x1b[31mred" in out and "=== train row" in out


@pytest.mark.parametrize("argv, named", [
    (["prompt-eval", ".", "--max-new-tokens", "100000000"], "--max-new-tokens: must be a positive integer up to 32768"),
    (["chat", ".", "--max-new-tokens", "100000000"], "--max-new-tokens: must be a positive integer up to 32768"),
    (["audit", "--world-size", "1000000000"], "--world-size: must be a positive integer up to 16384"),
    (["audit", "--epochs", "1000000000"], "--epochs: must be a positive integer up to 1000"),
])
def test_flags_whose_work_grows_are_bounded(argv, named, capsys):
    started = time.monotonic()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err
    assert time.monotonic() - started < 30
