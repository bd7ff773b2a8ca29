"""transformers_import.py: transformers' table of its models, read from a checked cache file instead of being rebuilt
twice in every process; the same table transformers builds, and a cache file that is not right is never used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.core.paths import TINY_TOKENIZER_DIR
from tests.conftest import subprocess_env

# A fresh interpreter, as every launching process and rank starts: `hook` imports dsrecipes first (which installs
# the cache), `plain` never imports dsrecipes (transformers as it is). It prints a digest of both lazy modules'
# tables, the cache's counters, and a tokenizer loaded through the lazy table.
SCRIPT = f"""
import hashlib, json, sys
if sys.argv[1] == "hook":
    import dsrecipes
    from dsrecipes.rank.transformers_import import STATS
else:
    STATS = {{}}
    assert not any(type(f).__module__.startswith("dsrecipes") for f in sys.meta_path)
from transformers import AutoTokenizer
import transformers, transformers.models
def table(m):
    return {{"modules": sorted(m._modules), "all": sorted(m.__all__), "class_to_module": m._class_to_module,
             "missing": {{k: sorted(map(str, v)) for k, v in m._object_missing_backend.items()}}}}
text = json.dumps([table(transformers), table(transformers.models)], sort_keys=True)
print(hashlib.sha256(text.encode()).hexdigest(), len(text))
print(json.dumps(STATS, sort_keys=True))
print(type(AutoTokenizer.from_pretrained({str(TINY_TOKENIZER_DIR)!r})).__name__)
"""


def _run(mode: str, cache: Path) -> list:
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=300,
                          env=subprocess_env({"XDG_CACHE_HOME": str(cache)}))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def _cache_file(cache: Path) -> Path:
    (path,) = (cache / "dsrecipes" / "transformers").glob("*.json")
    return path


def test_the_cached_table_is_the_one_transformers_builds_and_a_second_process_reads_it(tmp_path):
    digest, stats, tokenizer = _run("plain", tmp_path / "unused")
    assert stats == "{}" and tokenizer == "TokenizersBackend" and int(digest.split()[1]) > 100_000
    first = _run("hook", tmp_path)  # builds the table once (transformers' own function), serves the 2nd call
    assert first[0] == digest and json.loads(first[1]) == {"computed": 1, "hits": 1, "read": 0} and first[2] == tokenizer
    second = _run("hook", tmp_path)  # reads both calls' tables from the file: transformers scans nothing
    assert second[0] == digest and json.loads(second[1]) == {"computed": 0, "hits": 2, "read": 1} and second[2] == tokenizer
    saved = json.loads(_cache_file(tmp_path).read_text())
    assert saved["format"] == 1 and len(saved["stamp"]) == 64


def _fake_tree(tmp_path: Path) -> Path:
    models = tmp_path / "models"
    (models / "llama").mkdir(parents=True)
    (models / "__init__.py").write_text("")
    (models / "llama" / "modeling_llama.py").write_text("__all__ = ['LlamaModel']")
    return models


TABLE = {frozenset({"torch"}): {"llama.modeling_llama": {"LlamaModel"}}, frozenset(): {"auto": {"AutoConfig"}}}


def _new_process(monkeypatch) -> None:
    """What a fresh process starts with: no table of its own yet (a process walks the tree and reads the file once)."""
    from dsrecipes.rank import transformers_import

    monkeypatch.setattr(transformers_import, "_LOADED", {})


@pytest.mark.parametrize("planted", [
    "not json {",
    json.dumps({"format": 1, "stamp": "0" * 64, "table": [[[], {"auto.tokenization_auto": ["AutoTokenizer"]}]]}),
    "SHAPE",  # the right stamp (copied from the real file) around a table of the wrong shape
])
def test_a_stale_or_malformed_cache_file_is_rebuilt_never_used(tmp_path, monkeypatch, planted):
    from dsrecipes.rank import transformers_import

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    models, built = _fake_tree(tmp_path), []
    build = lambda: built.append(1) or TABLE  # noqa: E731
    _new_process(monkeypatch)
    assert transformers_import.load_or_build(models, build) == TABLE and len(built) == 1
    path = _cache_file(tmp_path / "cache")
    real = json.loads(path.read_text())
    _new_process(monkeypatch)
    assert transformers_import.load_or_build(models, build) == TABLE and len(built) == 1  # read back, not built
    if planted == "SHAPE":
        planted = json.dumps({"format": 1, "stamp": real["stamp"], "table": [[["torch"], {"x": "not a list"}]]})
    path.write_text(planted)
    _new_process(monkeypatch)
    assert transformers_import.load_or_build(models, build) == TABLE and len(built) == 2
    assert json.loads(path.read_text()) == real  # rewritten with what transformers built


def test_a_cache_that_cannot_be_written_is_left_alone_and_the_table_still_built(tmp_path, monkeypatch):
    from dsrecipes.rank import transformers_import

    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    models, built = _fake_tree(tmp_path), []
    for _ in range(2):
        _new_process(monkeypatch)
        assert transformers_import.load_or_build(models, lambda: built.append(1) or TABLE) == TABLE
    assert len(built) == 2 and blocker.read_text() == "a file where the cache folder would be"


def test_other_folders_and_prefixes_go_through_as_transformers_has_them(tmp_path, monkeypatch):
    from dsrecipes.rank import transformers_import

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _new_process(monkeypatch)
    models, calls, table = _fake_tree(tmp_path), [], TABLE

    def original(module_path, prefix=None):
        calls.append((str(module_path), prefix))
        return {backends: {name: set(objects) for name, objects in modules.items()} for backends, modules in table.items()}

    define = transformers_import._cached(original, models.resolve())
    assert define(tmp_path / "elsewhere", "x") == table  # not the models folder: transformers' own answer
    assert calls == [(str(tmp_path / "elsewhere"), "x")]
    prefixed = define(models, prefix="models")
    assert prefixed == {frozenset({"torch"}): {"models.llama.modeling_llama": {"LlamaModel"}},
                        frozenset(): {"models.auto": {"AutoConfig"}}}
    prefixed[frozenset()]["models.auto"].add("changed in place")  # as transformers/__init__.py does with its copy
    assert define(str(models / "__init__.py")) == table  # a file means its folder; the cached table is intact
    assert [c for c in calls if c[0] == str(models.resolve())] == [(str(models.resolve()), None)]  # built once
    (models / "llama" / "modeling_llama.py").write_text("__all__ = []")  # a file changed (size): the next process ...
    assert define(models) == table  # (this one keeps the table it has, as transformers' own lru_cache would)
    _new_process(monkeypatch)
    define(models)  # ... builds it again
    assert [c for c in calls if c[0] == str(models.resolve())] == [(str(models.resolve()), None)] * 2
