"""core/publish.py: the one way a finished directory appears (checkpoints, exports, shards, prepared data)."""

from __future__ import annotations

import ctypes
import errno

import pytest

from dsrecipes.core import publish
from dsrecipes.core.publish import Existing, publish_dir, staging_dir


def _filled(path, name, text):
    path.mkdir(exist_ok=True)
    (path / name).write_text(text)
    return path


def test_new_target_is_one_rename(tmp_path):
    target = tmp_path / "out"
    staging = _filled(staging_dir(target), "a", "new")
    assert staging.parent == tmp_path and staging.name.startswith(".out.tmp-")
    assert publish_dir(staging, target) is None
    assert (target / "a").read_text() == "new" and not staging.exists()


def test_empty_target_is_replaced(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    staging = _filled(staging_dir(target), "a", "new")
    assert publish_dir(staging, target) is None
    assert (target / "a").read_text() == "new"


def test_refuse_leaves_both_untouched(tmp_path):
    target = _filled(tmp_path / "out", "mine.txt", "user's")
    staging = _filled(staging_dir(target), "a", "new")
    with pytest.raises(FileExistsError):
        publish_dir(staging, target)
    assert (target / "mine.txt").read_text() == "user's" and (staging / "a").is_file()


def test_keep_discards_ours(tmp_path):
    target = _filled(tmp_path / "out", "a", "theirs")
    staging = _filled(staging_dir(target), "a", "ours")
    assert publish_dir(staging, target, Existing.keep) is None
    assert (target / "a").read_text() == "theirs" and not staging.exists()


def _exchange_and_check(tmp_path):
    target = _filled(tmp_path / "out", "a", "old")
    staging = _filled(staging_dir(target), "a", "new")
    previous = publish_dir(staging, target, Existing.exchange)
    assert previous == staging
    assert (target / "a").read_text() == "new" and (previous / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", staging.name])


def test_exchange_returns_the_previous_directory(tmp_path):
    _exchange_and_check(tmp_path)


def test_exchange_fallback_without_renameat2(tmp_path, monkeypatch):
    class NoExchange:
        def __getattr__(self, name):
            def fails(*args):
                ctypes.set_errno(errno.ENOSYS)
                return -1
            return fails

    monkeypatch.setattr(publish.ctypes, "CDLL", lambda *a, **k: NoExchange())
    _exchange_and_check(tmp_path)


def test_exchange_fallback_puts_the_previous_back_when_the_swap_fails(tmp_path, monkeypatch):
    target = _filled(tmp_path / "out", "a", "old")
    monkeypatch.setattr(publish.ctypes, "CDLL", lambda *a, **k: object())  # no renameat2 at all
    with pytest.raises(OSError):
        publish.exchange(tmp_path / "missing", target)
    assert (target / "a").read_text() == "old"
