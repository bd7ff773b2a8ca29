"""What reaches the user's terminal, and the messages of a few hostile inputs, all in this process:

- a fine-tuned model's text (`chat`'s streamed reply, `prompt-eval`'s side by side) with its control characters
  escaped: a model that learned to emit ESC sequences (window title, OSC 52 clipboard write, clear screen) printed
  them raw; the text kept (chat history, --json) is exact;
- `doctor` prints its findings and nothing else (DeepSpeed's "Setting accelerator to CPU" warning reached stderr);
- a whole number longer than Python converts (4300 digits), in an override or a recipe file, is one message naming
  the key or file:line (was Python's "Exceeds the limit (4300 digits) for integer string conversion" alone);
- a FIFO given as a data file is "not a regular file", never opened (was "matches no file").
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, List

import pytest

from tests.test_messages_hostile import refused as _refused

EVIL = "4 \x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x9b31m done\n\tnext\u3000line"
SHOWN = "4 \\x1b]0;pwned\\x07\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b[2J\\x9b31m done\n\tnext\u3000line"
refused = functools.partial(_refused, one_line=True)  # (and stderr is the `error:` line alone)


class _Tokenizer:
    def decode(self, ids: Any, **kwargs: Any) -> str:
        return EVIL if ids else ""

    def convert_ids_to_tokens(self, i: int) -> str:
        return "<|im_end|>"


class _Model:
    """A ChatModel that answers EVIL through the streamer, as generate() does."""

    tokenizer = _Tokenizer()
    stop_ids = [0]

    def prompt_text(self, history: Any) -> str:
        return "prompt"

    def encode(self, text: str) -> List[int]:
        return [7]

    def generate(self, prompt_ids: List[int], max_new_tokens: int, streamer: Any = None) -> List[int]:
        import torch

        streamer.put(torch.tensor([prompt_ids]))  # generate() streams the prompt first (skipped)
        streamer.put(torch.tensor([5, 0]))
        streamer.end()
        return [5, 0]

    def answer_text(self, ids: List[int]) -> str:
        return EVIL


def test_chat_reply_shows_control_characters_escaped_and_keeps_the_exact_text(capsys):
    from dsrecipes.commands.chat import reply_turn

    history: List[dict] = []
    assert reply_turn(_Model(), history, "hi", 4) == EVIL
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out, repr(out)
    assert out == SHOWN + "\n", repr(out)
    assert history[-1] == {"role": "assistant", "content": EVIL}


def test_prompt_eval_side_by_side_shows_control_characters_escaped(capsys):
    from dsrecipes.serve.prompt_eval import PromptRow, Score, print_side_by_side

    row = PromptRow(messages=[{"role": "user", "content": "q"}], tools=None, reference="ref\x1b[2J", title="q\x1b]0;t\x07")
    print_side_by_side([row], {"baseline": Score(answers=[EVIL]), "finetuned": Score(answers=["ok"])})
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out, repr(out)
    assert SHOWN in out and "q\\x1b]0;t\\x07" in out and "ref\\x1b[2J" in out


def test_doctor_prints_only_its_findings(capsys, monkeypatch, tmp_path):
    """DeepSpeed warns "Setting accelerator to CPU" (its logger, on import) on a machine without a GPU; a recipe
    that does not compose is a note, its key's control characters escaped."""
    from deepspeed.accelerator import real_accelerator

    from dsrecipes.commands.doctor import main as doctor
    from dsrecipes.core.console import _DeepSpeedFilter

    logger = logging.getLogger("DeepSpeed")  # as in a fresh process: no filter yet, the accelerator not yet picked
    monkeypatch.setattr(logger, "filters", [f for f in logger.filters if not isinstance(f, _DeepSpeedFilter)])
    monkeypatch.setattr(real_accelerator, "ds_accelerator", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    seen: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    recipe = tmp_path / "r.yaml"
    recipe.write_text('"trainer.bogus\\e]0;title\\a": 1\n')
    try:
        doctor(["--json", f"recipe={recipe}"])
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert not [m for m in seen if "Setting accelerator" in m] and "Setting accelerator" not in err, (seen, err)
    assert "\x1b" not in err and "trainer.bogus\\x1b]0;title\\x07: unknown key" in err, err


def test_an_override_with_more_digits_than_python_reads_names_its_key(capsys):
    number = "1" + "9" * 5000
    err = refused(capsys, ["validate", f"trainer.max_steps={number}"],
                  "trainer.max_steps: a whole number of 5001 digits does not fit in 64 bits")
    assert "integer string conversion" not in err and len(err) < 300, err
    refused(capsys, ["validate", f"optimizer.betas=[0.9,{number}]"], "optimizer.betas: a whole number of 5001")


def test_a_recipe_file_with_more_digits_than_python_reads_names_its_line(capsys, tmp_path):
    recipe = tmp_path / "big.yaml"
    recipe.write_text("# too big\noptimizer:\n  lr: 1.0e-4\ntrainer.max_steps: " + "9" * 5000 + "\n")
    err = refused(capsys, ["validate", f"recipe={recipe}"], f"{recipe}:4: a whole number of 5000 digits")
    assert len(err) < 300, err


@pytest.mark.timeout(30)
def test_a_fifo_as_a_data_file_is_not_a_regular_file(capsys, tmp_path):
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    refused(capsys, ["validate", f"dataset.paths=[{fifo}]"],
            f"dataset.paths[0]: '{fifo}' is not a regular file")
    refused(capsys, ["validate", f"dataset.val_paths=[{tmp_path}/*.jsonl]"],
            f"dataset.val_paths[0]: '{tmp_path}/*.jsonl' matches no regular file ('{fifo}' is not a regular file")
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "moved.jsonl")  # was 'not a regular file (a FIFO, ...)'
    refused(capsys, ["validate", f"dataset.paths=[{tmp_path}/gone.jsonl]"],
            f"'{tmp_path}/gone.jsonl' is a symbolic link to '{tmp_path}/moved.jsonl', which does not exist")



def test_a_path_too_long_for_the_file_system_is_one_message(capsys, tmp_path):
    """A name past 255 bytes raised ENAMETOOLONG from the first stat() of export, prompt-eval, shard, inspect-data:
    a traceback; nothing is made."""
    long = str(tmp_path / ("a" * 300))
    for argv in (["export", long, "--out", str(tmp_path / "e")], ["export", str(tmp_path), "--out", long],
                 ["shard", "--parts", "2", "--out", long], ["inspect-data", "--run-dir", long]):
        refused(capsys, argv, f"{long[:200]}...: file name too long")
    assert list(tmp_path.iterdir()) == []


def test_a_chat_message_longer_than_a_file_name_is_a_message_not_a_path(capsys, tmp_path):
    """`chat RUN --message TEXT`: TEXT past 255 bytes was looked at as a run directory (where the command's log
    goes) and raised ENAMETOOLONG before the model was even looked at."""
    refused(capsys, ["chat", str(tmp_path), "--message", "why? " * 60], f"{tmp_path}: not a run directory")


@pytest.mark.parametrize("argv, needle", [
    (["audit", "--num-workers", "99999999999"], "data.num_workers: must be from 0 to 1024"),
    (["validate", "data.preprocess_workers=100000"], "data.preprocess_workers: must be from 1 to 1024"),
])
def test_worker_counts_past_any_machine_are_refused(capsys, argv, needle):
    """`audit --num-workers 99999999999` simulated 10^11 DataLoader workers (killed after minutes); training would
    fork that many per rank."""
    refused(capsys, argv, needle)


def test_a_recipe_path_without_yaml_names_the_file_looked_for(capsys, tmp_path):
    """`recipe=/etc/passwd` said 'no such file: /etc/passwd' of a file that exists: /etc/passwd.yaml is read."""
    named = tmp_path / "notes.txt"
    named.write_text("trainer.max_steps: 3\n")
    refused(capsys, ["validate", f"recipe={named}"],
            f"no such file: {named}.yaml ({named} is not read as a recipe: a recipe file's name ends in .yaml")
    refused(capsys, ["validate", f"recipe={tmp_path}/gone"], f"no such file: {tmp_path}/gone.yaml [")


@pytest.mark.parametrize("overrides, needle", [
    (["=5"], "cannot parse override '=5': no key before '='"),  # was Hydra's 'Config group override must be ...'
    (["a" * 300 + "=1"], "'" + "a" * 40 + "...' (300 characters): no such key or config group"),  # was ENAMETOOLONG
    (["trainer.max_steps=${trainer.save_every}", "trainer.save_every=${trainer.max_steps}"],
     "trainer.max_steps: its value refers to itself"),  # was 'Recursive interpolation detected; full_key: ...'
])
def test_overrides_hydra_cannot_read_are_named(capsys, overrides, needle):
    err = refused(capsys, ["validate", *overrides], needle)
    assert "hydra/conf" not in err and "Got int" not in err and "reference_type" not in err, err


def test_score_keeps_a_users_dangling_link_at_out(capsys, tmp_path):
    """`score --out LINK` with LINK pointing nowhere: out.exists() was False, and the rewards replaced the link."""
    import json

    model = tmp_path / "rm"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                   "num_labels": 1}))
    (model / "model.safetensors").write_bytes(b"")
    out = tmp_path / "rewards.jsonl"
    out.symlink_to(tmp_path / "elsewhere.jsonl")
    refused(capsys, ["score", str(model), "--pairs", str(tmp_path / "pairs.jsonl"), "--out", str(out)],
            f"--out: {out} exists (a symbolic link)")
    assert out.is_symlink() and not (tmp_path / "elsewhere.jsonl").exists()


def test_a_command_naming_a_checkpoint_logs_into_its_run_not_into_the_checkpoint(tmp_path):
    """`export RUN/checkpoints/step_N` (documented as RUN --tag step_N): the checkpoint holds a config.yaml, so the
    command's log went to RUN/checkpoints/step_N/logs/export.log, a file the checkpoint was not written with; the
    next export refused the checkpoint as damaged ('added later')."""
    from dsrecipes.core.console import command_log

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    for where in (run, step):
        (where / "config.yaml").write_text("{}")
    (step / "complete.json").write_text("{}")
    assert command_log([str(step), "--out", str(tmp_path / "x")], "export") == run / "logs" / "export.log"
    assert command_log([str(run), "--out", str(step / "x")], "export") == run / "logs" / "export.log"


@pytest.mark.parametrize("text, needle", [
    ('{"base_model_name_or_path": 5}', "a LoRA adapter whose base model 5 is not a local model directory"),
    ('{"base_model_name_or_path": ["a"]}', "a LoRA adapter whose base model ['a'] is not"),
    ('{"base_model_name_or_path": "x",', "adapter_config.json: unreadable (Expecting"),
    ('\udcff', "adapter_config.json: unreadable ('utf-8' codec can't decode"),
    ('[1]', "adapter_config.json: holds a list, not a JSON object"),
])
def test_a_hostile_adapter_config_is_one_message(capsys, tmp_path, text, needle):
    """chat / prompt-eval on an adapter export: a base that is not a string (TypeError), or an adapter_config.json
    that is not JSON or not UTF-8 (JSONDecodeError / UnicodeDecodeError) were tracebacks."""
    (tmp_path / "adapter_config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    refused(capsys, ["chat", str(tmp_path), "--message", "hi"], needle)


def test_a_model_directory_transformers_cannot_read_is_one_message(capsys, tmp_path):
    """A base model directory nobody signed, with a tokenizer.json that is not JSON: chat printed transformers'
    JSONDecodeError traceback (exit 1)."""
    import json

    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer.json").write_text("{bad")
    refused(capsys, ["chat", str(tmp_path), "--message", "hi"],
            f"{tmp_path}: does not load as a chat model (JSONDecodeError: ")


def test_a_model_config_of_the_wrong_type_is_a_config_error_naming_the_key(tmp_path):
    """model.path with config.json vocab_size: "x" passed validate, and training's first load of the tokenizer was
    huggingface_hub's StrictDataclassFieldValidationError traceback (an Exception, not the ValueError caught)."""
    import json
    import shutil

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.errors import ConfigError
    from dsrecipes.core.paths import TINY_TOKENIZER_DIR
    from dsrecipes.core.tokenizer import load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(TINY_TOKENIZER_DIR, model)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": "x"}))
    cfg = compose_and_load([f"model.tokenizer_path={model}"], check_files=False)
    with pytest.raises(ConfigError, match=rf"^model\.tokenizer_path: {model} does not load as a tokenizer: Valid"):
        load_tokenizer(cfg)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name, text, needle", [
    ("rank0.jsonl", None, "rank0.jsonl is not a regular file"),  # a FIFO: the audit waited for a writer for ever
    ("rankX.jsonl", "{}", "rankX.jsonl is not a rank's ledger (rank<N>.jsonl"),  # was int()'s ValueError
    ("rank0.jsonl", "{bad\n", "rank0.jsonl:1: not a ledger record (not JSON"),  # was JSONDecodeError
    ("rank0.jsonl", '{"epoch": 0, "step": 1, "ids": ["a"]}\n[1]\n', "rank0.jsonl:2: not a ledger record"),
])
def test_audit_ledger_of_a_hostile_run_directory_is_one_message(capsys, tmp_path, name, text, needle):
    import os

    (tmp_path / "ledger").mkdir()
    if text is None:
        os.mkfifo(tmp_path / "ledger" / name)
    else:
        (tmp_path / "ledger" / name).write_text(text)
    refused(capsys, ["audit", "--ledger", str(tmp_path)], needle)


def test_audit_refuses_more_rank_epochs_than_minutes_hold(capsys):
    """`audit --world-size 16384 --epochs 1000` (each within its bound) simulated for minutes without a line."""
    refused(capsys, ["audit", "--world-size", "16384", "--epochs", "1000"],
            "--world-size 16384 x --epochs 1000: more than 2,000,000 rank-epochs")


class _FullDisk:
    """A stdout on a full disk: every write fails as /dev/full's does (ENOSPC)."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("argv", [["ls"], ["show"], ["--help"], ["--version"], ["validate"]])
def test_a_full_stdout_is_one_message(capsys, monkeypatch, argv):
    """`dsrecipes show > /dev/full` was an OSError traceback (exit 1)."""
    capsys.readouterr()
    monkeypatch.setattr("sys.stdout", _FullDisk())
    refused(capsys, argv, "could not write to standard output: No space left on device")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_command_writing_to_dev_full_ends_with_one_message_and_no_exit_time_traceback():
    """The real file: the message, exit 2, and no 'Exception ignored' from the interpreter's own flush at exit."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "dsrecipes", "ls"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "error: could not write to standard output: No space left on device (the output was not " \
                          "complete)\n", done.stderr
