"""The run's tokenizer loads from `~` paths wherever a command loads it (inspect-data composed a config without the
launch's derived defaults and handed `~/...` to transformers, which took it for a Hub id and printed a traceback), and
a directory that does not load as a tokenizer is one ConfigError naming the key."""

import dataclasses
import shutil

import pytest

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.paths import TINY_TOKENIZER_DIR
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.tokenizer import load_tokenizer


def _cfg(**model):
    cfg = TrainConfig()
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def test_a_home_relative_tokenizer_path_loads(tmp_path, monkeypatch):
    shutil.copytree(TINY_TOKENIZER_DIR, tmp_path / "tok")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_tokenizer(_cfg(path="~/tok")).pad_token is not None


def test_a_directory_without_a_tokenizer_is_one_message_naming_the_key(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^model\.tokenizer_path: .*empty does not load as a tokenizer"):
        load_tokenizer(_cfg(tokenizer_path=str(tmp_path / "empty")))
