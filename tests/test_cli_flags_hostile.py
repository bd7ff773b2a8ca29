"""Flag values that make no sense, and paths that are not ours, on the command line of the subcommands.

Every case is one message naming the flag, exit 2, no traceback: a value is refused by the flag's type
(commands/args.py), never replaced by a default; `inspect-data --run-dir` and `prompt-eval --json` write only into
a new path or one they wrote before, and a refused one leaves every file byte for byte as it was, nothing added.
All in this process (`dsrecipes.cli.main`); the models are test_prompt_eval's two untrained tiny exports.
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests.test_messages_hostile import refused
from tests.test_prompt_eval import two_models  # noqa: F401  (the module-scoped exports)
from tests.test_run_ownership import snapshot
from tests.test_sweep import dsrecipes_in_process

PROMPT = b'{"prompt": "What is 2 + 2?", "reference": "4"}\n'  # --prompts: one, so that generating is quick


def write_files(root: Path, files: dict) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


# ---------------------------------------------------------------------------------------------------------------
# Paths that are not ours


INSPECT_DIRS: dict = {  # --run-dir (relative to tmp_path) -> the files already there
    "foreign": {"foreign/prepare_stats.json": b"my notes", "foreign/quarantine.jsonl": b"keep me\n"},
    "run": {"run/dsrecipes_run.json": b'{"dsrecipes_run": 1}', "run/prepare_stats.json": b'{"rows": 1}'},
    "run_config": {"run_config/config.yaml": b"trainer: {}\n", "run_config/dsrecipes_inspect.json":
                   b'{"dsrecipes_inspect": 1}'},
    "forged": {"forged/dsrecipes_inspect.json": b"not ours", "forged/prepare_stats.json": b"theirs"},
    "a_file": {"a_file": b"a file, not a directory"},
    "a_file/below": {"a_file": b"a file, not a directory"},
}


@pytest.mark.parametrize("run_dir", list(INSPECT_DIRS))
def test_inspect_data_writes_only_into_a_new_empty_or_its_own_directory(run_dir, tmp_path, capsys):
    """A foreign directory, a training run's directory, a forged marker, a file, a path below a file: refused
    before any work, every file as it was and nothing added (no marker, no statistics, no directory)."""
    write_files(tmp_path, INSPECT_DIRS[run_dir])
    before = snapshot(tmp_path)
    refused(capsys, ["inspect-data", f"data.cache_dir={tmp_path / 'cache'}", "dataset.max_samples=20",
                     "--run-dir", str(tmp_path / run_dir)], "--run-dir")
    assert snapshot(tmp_path) == before


def test_inspect_data_writes_again_into_a_directory_it_made(tmp_path, capsys):
    out = tmp_path / "new" / "stats"
    argv = ["inspect-data", f"data.cache_dir={tmp_path / 'cache'}", "dataset.max_samples=60", "dataset.val_size=4",
            "--rows", "0", "--run-dir", str(out)]
    assert dsrecipes_in_process(*argv) == 0 and dsrecipes_in_process(*argv) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["dsrecipes_inspect.json", "prepare_stats.json"]


def json_targets(tmp_path: Path, export: Path) -> dict:
    """--json paths prompt-eval must refuse before it loads a model: name -> (path, the foreign files made)."""
    write_files(tmp_path, {"notes.json": b'{"mine": true}\n', "a_file": b"x", "dir/keep": b"y", "p.jsonl": PROMPT,
                           "run/dsrecipes_run.json": b'{"dsrecipes_run": 1}', "run/checkpoints/latest": b"step_4"})
    return {"notes": tmp_path / "notes.json", "directory": tmp_path / "dir", "export_config": export / "config.json",
            "below_a_file": tmp_path / "a_file" / "s.json", "inside_export": export / "scores.json",
            "run_checkpoints": tmp_path / "run" / "checkpoints" / "scores.json"}


@pytest.mark.parametrize("target", ["notes", "directory", "below_a_file", "export_config", "inside_export",
                                    "run_checkpoints"])
def test_prompt_eval_json_never_replaces_a_file_it_did_not_write(target, two_models, tmp_path, capsys):  # noqa: F811
    """A user's file, a directory, a path below a file, an export's own config.json or a new file in an export or a
    run's checkpoints: refused before any generation, the export and every file untouched."""
    export = two_models[1]
    path = json_targets(tmp_path, export)[target]
    before, export_before = snapshot(tmp_path), snapshot(export)
    refused(capsys, ["prompt-eval", "--finetuned", str(export), "--prompts", str(tmp_path / "p.jsonl"),
                     "--max-new-tokens", "1", "--json", str(path)], "--json")
    assert snapshot(tmp_path) == before and snapshot(export) == export_before


def test_prompt_eval_json_replaces_its_own_result_and_a_failed_write_is_one_message(two_models, tmp_path, capsys,  # noqa: F811
                                                                                     monkeypatch):
    out, prompts = tmp_path / "scores.json", write_files(tmp_path, {"p.jsonl": PROMPT}) / "p.jsonl"
    argv = ["prompt-eval", "--finetuned", str(two_models[1]), "--prompts", str(prompts), "--max-new-tokens", "1",
            "--json", str(out)]
    assert dsrecipes_in_process(*argv) == 0 and dsrecipes_in_process(*argv) == 0  # the second replaces the first
    assert json.loads(out.read_text())["dsrecipes_prompt_eval"] == 1
    before = snapshot(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("dsrecipes.serve.prompt_eval.atomic_write_json", disk_full)
    assert "No space left on device" in refused(capsys, argv, "--json")
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------------------------
# Values that make no sense


def bad_inputs(tmp_path: Path, export: Path) -> Callable[[str], str]:
    """Files for the cases below (a prompts file that is not UTF-8, configs that are not a model's, prompts), and
    what puts the paths into a case's words: EXPORT is the model, TMP the test's directory."""
    write_files(tmp_path, {"latin1.jsonl": '{"prompt": "caf\xe9"}\n'.encode("latin-1"), "notes.txt": b"hello\n",
                           "broken/config.json": b"{not json", "untyped/config.json": b'{"hidden_size": 8}',
                           "p.jsonl": PROMPT})
    return lambda text: text.replace("EXPORT", str(export)).replace("TMP", str(tmp_path))


@pytest.mark.parametrize("argv,needle", [
    ("chat EXPORT --message hi --max-new-tokens 0", "--max-new-tokens"),
    ("chat EXPORT --message hi --max-new-tokens -3", "--max-new-tokens"),
    ("prompt-eval --finetuned EXPORT --prompts TMP/latin1.jsonl --max-new-tokens 0", "--max-new-tokens"),
    ("prompt-eval --finetuned EXPORT --prompts TMP/latin1.jsonl", "--prompts"),
    ("prompt-eval --finetuned EXPORT --prompts TMP", "--prompts: TMP is a directory"),
    ("audit --world-size -2 --num-rows 64", "--world-size"),
    ("show --world-size -1", "--world-size"),
    ("audit --num-rows -5", "--num-rows"),
    ("estimate --hf-config TMP/notes.txt", "--hf-config: TMP/notes.txt"),
    ("estimate --hf-config TMP/broken", "--hf-config: TMP/broken/config.json is unreadable"),
    ("estimate --hf-config TMP/untyped", "--hf-config: TMP/untyped/config.json has no model_type"),
    ("estimate --hf-config TMP/nope", "--hf-config: must be an existing path, got 'TMP/nope'"),
    ("estimate --hf-config TMP", "--hf-config: TMP has no config.json"),
])
def test_values_that_raised_are_one_message(argv, needle, two_models, tmp_path, capsys):  # noqa: F811
    """Each of these once ended in a traceback (exit 1), some after loading the model."""
    paths = bad_inputs(tmp_path, two_models[0])
    refused(capsys, paths(argv).split(), paths(needle))


@pytest.mark.parametrize("argv,flag", [
    ("audit --world-size 0 --num-rows 64", "--world-size"),
    ("show --world-size 0", "--world-size"),
    ("estimate --gpus-per-node 0", "--gpus-per-node"),
    ("audit --epochs 0 --num-rows 64", "--epochs"),
    ("audit --epochs -1 --num-rows 64", "--epochs"),
    ("estimate --nodes -1", "--nodes"),
    ("estimate --gpu-mem-gb -5", "--gpu-mem-gb"),
    ("prompt-eval --finetuned EXPORT --prompts TMP/p.jsonl --limit 0", "--limit"),
    ("prompt-eval --finetuned EXPORT --prompts TMP/p.jsonl --limit -1", "--limit"),
    ("chat EXPORT --message hi --trust-checkpoint TMP/nonexistent", "--trust-checkpoint"),
    ("train --trust-checkpoint TMP/nonexistent", "--trust-checkpoint"),
    ("train --trust-checkpoint=TMP/nonexistent model=tiny", "--trust-checkpoint"),
    ("audit --ledger TMP/nonexistent", "--ledger"),
    ("inspect-data --rows -1", "--rows"),
])
def test_values_once_replaced_by_a_default_are_refused(argv, flag, two_models, tmp_path, capsys):  # noqa: F811
    """Each of these once ran (exit 0) with another value than the one given, or failed as if the data were wrong."""
    refused(capsys, bad_inputs(tmp_path, two_models[0])(argv).split(), f"argument {flag}: must be ")


@pytest.mark.parametrize("argv,prog", [
    (["--bogus"], "dsrecipes train"),
    (["train", "--bogus"], "dsrecipes train"),
    (["show", "--bogus"], "dsrecipes show"),
    (["chat", "x", "--bogus"], "dsrecipes chat"),
    (["prompt-eval", "--bogus"], "dsrecipes prompt-eval"),
])
def test_usage_errors_name_dsrecipes_and_the_subcommand_under_python_m(argv, prog, monkeypatch, capsys):
    """Under `python -m dsrecipes`, sys.argv[0] is dsrecipes/__main__.py: argparse would name that."""
    monkeypatch.setattr(sys, "argv", [str(Path(__file__).parents[1] / "dsrecipes" / "__main__.py"), *argv])
    line = refused(capsys, argv, f"{prog}: ")
    assert "__main__" not in line and f"(see {prog} --help)" in line
