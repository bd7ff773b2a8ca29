"""`dsrecipes validate` refuses what a run would refuse about names, before anything is read or loaded: registry
entries (`dataset.use`), a validation file that is also trained on, template tokens the tokenizer splits - and a run
refuses the same with the same words."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.cli import main
from dsrecipes.core.paths import SAMPLE_DATA_DIR
from tests.conftest import REPO, subprocess_env


def _validate(capsys, *overrides):
    code = main(["validate", *overrides])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err + captured.out


@pytest.fixture
def registry(tmp_path):
    """The README's dataset_info.json example, with its files."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"### Datasets by name.*?```json\n(.*?)```", readme, re.S).group(1)
    info = json.loads(block)
    data = tmp_path / "data"
    (data / "chats").mkdir(parents=True)
    shutil.copy(SAMPLE_DATA_DIR.parent / "glaive_toolcall" / "glaive_toolcall_en_demo.json.gz", data)
    (data / "chats" / "a.jsonl").write_text(json.dumps({"conversations": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    (data / "alpaca_de.jsonl").write_text(json.dumps({"instruction": "Sag hallo", "output": "Hallo"}) + "\n")
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data / "dataset_info.json"


def test_the_readme_registry_validates_and_a_missing_name_is_refused(registry, capsys):
    code, out = _validate(capsys, f"dataset.registry={registry}", "dataset.use=[glaive_en,my_chats,alpaca_de]")
    assert code == 0 and out.startswith("OK:"), out
    code, out = _validate(capsys, f"dataset.registry={registry}", "dataset.use=[glaive_en,glaive_eng]")
    assert code == 2 and "dataset.use: 'glaive_eng' is not in" in out and "entries: alpaca_de, glaive_en, my_chats" in out
    assert "; did you mean glaive_en? (entries:" in out, out


def test_a_registry_entry_the_run_cannot_use_is_refused(registry, capsys):
    info = json.loads(registry.read_text())
    info["remote"] = {"hf_hub_url": "org/data"}
    registry.write_text(json.dumps(info))
    code, out = _validate(capsys, f"dataset.registry={registry}", "dataset.use=[remote]")
    assert code == 2 and "only local `file_name` entries are supported" in out, out


def test_a_validation_file_that_is_trained_on_is_refused(tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    shutil.copy(SAMPLE_DATA_DIR / "train.jsonl", train)
    (tmp_path / "link.jsonl").symlink_to(train)
    code, out = _validate(capsys, "data=iterable", "trainer.max_steps=3", f"dataset.paths=[{train}]",
                          f"dataset.val_paths=[{tmp_path / 'link.jsonl'}]")
    assert code == 2 and "is the same file as the training file" in out, out


@pytest.fixture
def foreign_tokenizer(tmp_path):
    """A real fast tokenizer with no special tokens, no eos and no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz <>|_/")}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    out = tmp_path / "tok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "unk_token": "[UNK]", "pad_token": "[UNK]"}))
    return out


def test_template_tokens_are_checked_without_importing_torch(foreign_tokenizer, tmp_path):
    code = ("import sys; from dsrecipes.cli import main; "
            "codes = [main(['validate', f'model.tokenizer_path={sys.argv[1]}', f'template={t}']) "
            "for t in ('chatml', 'plain', 'tokenizer', 'auto', 'llama3')]; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'validate imported torch'; "
            "print(codes)")
    out = subprocess.run([sys.executable, "-c", code, str(foreign_tokenizer)], capture_output=True, text=True,
                         cwd=tmp_path, env=subprocess_env(), timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[2, 2, 2, 2, 2]", out.stderr
    assert "template.name: chatml needs '<|im_start|>' as one token" in out.stderr
    assert "template.name: plain ends replies with the eos token, and this tokenizer has none" in out.stderr
    assert "template.name: tokenizer, but this tokenizer has no chat_template" in out.stderr
    assert "template.name: llama3 needs '<|eot_id|>' as one token" in out.stderr


def test_the_shipped_tokenizers_pass(capsys, smollm2_dir):
    for overrides in ([], ["template=llama3"], ["template=vicuna"], [f"model.path={smollm2_dir}"],
                      [f"model.path={smollm2_dir}", "template=chatml"]):
        code, out = _validate(capsys, *overrides)
        assert code == 0, (overrides, out)


@pytest.mark.slow
def test_a_run_refuses_what_validate_refuses_with_the_same_words(registry, foreign_tokenizer, tmp_path, capsys):
    for overrides in ([f"dataset.registry={registry}", "dataset.use=[glaive_eng]"],
                      [f"model.tokenizer_path={foreign_tokenizer}", "template=plain"]):
        _, said = _validate(capsys, *overrides)
        run = subprocess.run([sys.executable, "-m", "dsrecipes", *overrides, "launcher.dry_run=true",
                              f"trainer.output_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"],
                             capture_output=True, text=True, cwd=tmp_path, env=subprocess_env(), timeout=300)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
        first = said.strip().splitlines()[0].removeprefix("error: ")
        assert first in run.stderr, (first, run.stderr[-2000:])
        shutil.rmtree(tmp_path / "run", ignore_errors=True)
        assert Path(tmp_path).is_dir()
