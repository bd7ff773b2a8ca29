"""A commit record from someone else (a checkpoint trusted with --trust-checkpoint) whose file list has the wrong
shape, or names files outside its directory: one message naming complete.json and the entry, exit 2, nothing read
outside the checkpoint and nothing written (manifest.shape_problem, manifest.verify).

The list cases run on a directory of a few files (fast); the command-line cases share one tiny trained run
(4 steps, one checkpoint) and each damage a copy of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.core import manifest
from tests import test_run_safety as safety
from tests.conftest import subprocess_env
from tests.test_run_ownership import snapshot

ws = safety.ws  # the module-scoped workspace fixture (the sample data, a data cache)


@pytest.fixture
def tag(tmp_path) -> Path:
    """A checkpoint-like directory (a nested file too) beside a file outside it, `outside/secret.txt`."""
    tag = tmp_path / "run" / "checkpoints" / "step_4"
    (tag / "rng").mkdir(parents=True)
    (tag / "config.yaml").write_text("model: tiny\n")
    (tag / "rng" / "rank0.pt").write_bytes(b"\0" * 100)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("not the checkpoint's\n")
    return tag


def entry_of(path: Path) -> dict:
    """A correct {"size", "hash"} entry for `path`: what a forger would list for a file outside the checkpoint."""
    size = path.stat().st_size
    return {"size": size, "hash": manifest.file_digest(path, size)}


def test_a_list_as_describe_writes_it_verifies(tag):
    files = manifest.describe(tag)
    assert manifest.verify(tag, files) is None and manifest.unlisted(tag, files) is None


def test_files_as_a_list_is_named_not_a_traceback(tag):
    expected = 'complete.json: files: expected {path: {"size": bytes, "hash": digest}}, got list'
    assert manifest.verify(tag, []) == expected
    assert manifest.unlisted(tag, []) == expected


@pytest.mark.parametrize("entry,problem", [
    (5, 'files["config.yaml"]: expected {"size": bytes, "hash": digest}, got 5'),
    ({"hash": "h"}, 'files["config.yaml"]["size"]: expected a number of bytes, got null'),
    ({"size": True, "hash": "h"}, 'files["config.yaml"]["size"]: expected a number of bytes, got true'),
    ({"size": -1, "hash": "h"}, 'files["config.yaml"]["size"]: expected a number of bytes, got -1'),
    ({"size": 12, "hash": 7}, 'files["config.yaml"]["hash"]: expected a digest (a string), got 7'),
], ids=["int", "no_size", "bool_size", "negative_size", "int_hash"])
def test_an_entry_of_another_shape_is_named(tag, entry, problem):
    files = {**manifest.describe(tag), "config.yaml": entry}
    assert manifest.verify(tag, files) == f"complete.json: {problem}"
    export = "dsrecipes_export.json: " + problem.replace("files[", "hashes[", 1)  # what an export's caller names
    assert manifest.verify(tag, files, listing="dsrecipes_export.json: hashes") == export


@pytest.mark.parametrize("rel", ["ABSOLUTE", "../../../outside/secret.txt", "rng/../../../../outside/secret.txt",
                                 "./config.yaml", "rng//rank0.pt", "", "a\x1b[31m"])
def test_only_plain_relative_paths_are_listed(tag, rel):
    """A path out of the directory (absolute, `..`) that lists the outside file with its true size and hash is
    refused before anything is read; so is any path `describe` never writes."""
    secret = tag.parents[2] / "outside" / "secret.txt"
    rel = str(secret) if rel == "ABSOLUTE" else rel
    problem = manifest.verify(tag, {**manifest.describe(tag), rel: entry_of(secret)})
    assert problem == (f"complete.json: files[{json.dumps(rel)}]: not a plain relative path (printable names joined "
                       "by '/', none of them empty, '.' or '..'); every listed file must lie inside the directory")
    assert not manifest.plain_relative(rel)


def test_a_link_out_of_the_directory_is_not_followed(tag):
    """A listed file that is a link to a file outside (or a directory link leading out) is refused, although the
    list has the outside file's true size and hash; a link that stays inside verifies."""
    secret = tag.parents[2] / "outside" / "secret.txt"
    (tag / "leak.txt").symlink_to(secret)
    (tag / "out").symlink_to(secret.parent, target_is_directory=True)
    (tag / "same.yaml").symlink_to("config.yaml")
    for rel in ("leak.txt", "out/secret.txt"):
        files = {"config.yaml": entry_of(tag / "config.yaml"), rel: entry_of(secret)}
        assert manifest.verify(tag, files) == (f"{rel}: a link leading outside the directory; every listed file "
                                               "must lie inside it")
    assert manifest.verify(tag, {"same.yaml": entry_of(tag / "config.yaml")}) is None


@pytest.mark.timeout(60)  # reading the FIFO blocked for ever before
def test_a_listed_fifo_or_link_loop_is_a_problem_not_a_hang(tag):
    os.mkfifo(tag / "pipe")
    (tag / "loop").symlink_to("loop")
    assert manifest.verify(tag, {"pipe": {"size": 0, "hash": "h"}}) == "pipe: not a regular file"
    assert manifest.verify(tag, {"loop": {"size": 0, "hash": "h"}}).startswith("loop: unreadable (")


@pytest.fixture(scope="module")
def trained(ws) -> Path:
    run = ws / "base"
    code, out = safety.train(ws, run, "trainer.max_steps=4", "trainer.save_every=4", "trainer.export=false")
    assert code == 0, out[-3000:]
    return run


def foreign(trained: Path, dst: Path, files: object) -> Path:
    """A copy of the run whose checkpoint's record is unsigned (someone else's) and lists `files`."""
    run = safety.copy_run(trained, dst)
    record_path = run / "checkpoints" / "step_4" / "complete.json"
    record = json.loads(record_path.read_text())
    del record["signature"]
    record_path.write_text(json.dumps({**record, "files": files}))
    return run


@pytest.mark.slow
def test_export_of_a_malformed_foreign_record_is_one_message(ws, trained, tmp_path):
    run = foreign(trained, ws / "foreign_list", [])
    before = snapshot(run)
    done = subprocess.run([sys.executable, "-m", "dsrecipes", "export", str(run), "--out", str(tmp_path / "out"),
                           "--trust-checkpoint", str(run)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=subprocess_env())
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("error:") == 1
    assert 'step_4: complete.json: files: expected {path: {"size": bytes, "hash": digest}}, got list' in done.stderr
    assert not (tmp_path / "out").exists() and snapshot(run) == before


@pytest.mark.slow
def test_resume_from_a_malformed_foreign_record_is_refused(ws, trained):
    run = foreign(trained, ws / "foreign_int", {"config.yaml": 5})
    before = snapshot(run)
    code, out = safety.train(ws, run, "trainer.max_steps=8", "trainer.save_every=4", "trainer.export=false",
                      "--trust-checkpoint", str(run))
    assert code == 2 and "Traceback" not in out and out.count("error:") == 1, out[-3000:]
    assert 'complete.json: files["config.yaml"]: expected {"size": bytes, "hash": digest}, got 5' in out
    assert snapshot(run) == before
