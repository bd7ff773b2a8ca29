"""`dsrecipes shard --out DIR` against a user's directory and failures half way (issue: shard ownership).

DIR is ours only when it holds our manifest, and then only the files it lists; the shard is written beside DIR and
renamed (or, with --force, exchanged) into place, so every failure leaves DIR byte for byte as it was, with no
temporary directory beside it, and a failed --force leaves the previous shard complete and loadable.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from dsrecipes.core.paths import SAMPLE_DATA_DIR
from dsrecipes.data.shard.build import MANIFEST, QUARANTINE, SHARD_MARKER, read_manifest, verify_part
from tests.conftest import in_process_environ, subprocess_env

LINES = [ln for ln in (SAMPLE_DATA_DIR / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
         if ln.strip()][:60]


def shard(*argv: str) -> int:
    """`python -m dsrecipes shard ARGV` in this process: its exit code."""
    from dsrecipes.cli import main

    with in_process_environ():
        return main(["shard", *argv])


def shard_subprocess(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsrecipes", "shard", *argv], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)


def write_rows(path: Path, lines: List[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def snapshot(root: Path) -> Dict[str, bytes]:
    """Every entry below `root` (hidden ones included) with its bytes (directories as b'<dir>')."""
    return {p.relative_to(root).as_posix(): b"<dir>" if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def assert_intact_shard(out: Path | str, parts: int) -> None:
    manifest = read_manifest(str(out), world_size=parts)
    for rank in range(parts):
        verify_part(manifest, rank)


@pytest.fixture
def data(tmp_path) -> Path:
    return write_rows(tmp_path / "in" / "train.jsonl", LINES)


@pytest.fixture
def shard_dir(tmp_path, data) -> Path:
    """A complete shard of ours: 2 parts of the 60 rows."""
    out = tmp_path / "work" / "S"
    assert shard(str(data), "--parts", "2", "--out", str(out)) == 0
    return out


def test_user_part_files_in_out_are_refused_and_survive(tmp_path):
    """The reviewer's repro: DIR holds the user's own part_00/part_01 (the inputs). Before: both became 0 bytes."""
    d = tmp_path / "D"
    write_rows(d / "part_00.jsonl", LINES[:30])
    write_rows(d / "part_01.jsonl", LINES[30:])
    before = snapshot(tmp_path)
    out = shard_subprocess(tmp_path, "--parts", "2", "--out", str(d), f"dataset.paths=[{d}/part_*.jsonl]")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"--out: {d} is not empty (part_00.jsonl, part_01.jsonl)" in out.stderr
    assert "nothing was changed" in out.stderr
    assert snapshot(tmp_path) == before
    assert shard("--parts", "2", "--out", str(d), "--force", f"dataset.paths=[{d}/part_*.jsonl]") == 2
    assert snapshot(tmp_path) == before


def test_a_users_val_file_beside_the_data_is_not_replaced(tmp_path, capsys):
    d = tmp_path / "D"
    write_rows(d / "data.jsonl", LINES)
    write_rows(d / "val.jsonl", LINES[:5])
    before = snapshot(tmp_path)
    assert shard(str(d / "data.jsonl"), "--parts", "2", "--out", str(d), "--val-size", "10") == 2
    assert "is not empty (data.jsonl, val.jsonl)" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_a_manifest_json_of_someone_else_does_not_make_the_directory_ours(tmp_path, data, capsys):
    d = tmp_path / "D"
    write_rows(d / MANIFEST, [json.dumps({"version": 1, "parts": 1, "files": ["../train.jsonl"]})])
    write_rows(d / "part_00.jsonl", LINES[:3])
    before = snapshot(tmp_path)
    assert shard(str(data), "--parts", "2", "--out", str(d), "--force") == 2
    assert f"holds no {MANIFEST} written by `dsrecipes shard`" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_force_refuses_a_shard_directory_holding_files_its_manifest_does_not_list(shard_dir, data, capsys):
    (shard_dir / "notes.txt").write_text("keep me")
    (shard_dir / "part_07.jsonl").write_text("mine too")
    before = snapshot(shard_dir.parent)
    assert shard(str(data), "--parts", "3", "--out", str(shard_dir), "--force") == 2
    assert "holds notes.txt, part_07.jsonl, which its manifest.json does not list" in capsys.readouterr().err
    assert snapshot(shard_dir.parent) == before


def test_a_failed_force_leaves_the_previous_shard_complete(shard_dir, tmp_path, capsys):
    """Before: the parts were truncated in place while the old manifest still pointed at them."""
    bad = write_rows(tmp_path / "in" / "bad.jsonl", LINES[:20] + ["not json\n"] + LINES[20:])
    before = snapshot(shard_dir.parent)
    assert shard(str(bad), "--parts", "2", "--out", str(shard_dir), "--force", "dataset.bad_rows=error") == 2
    assert f"{bad}:21: invalid_json" in capsys.readouterr().err
    assert snapshot(shard_dir.parent) == before  # no temporary directory beside it either
    assert_intact_shard(shard_dir, 2)


def test_a_full_disk_is_one_message_and_leaves_the_previous_shard(shard_dir, data, monkeypatch, capsys):
    """An OSError while writing (here ENOSPC when the new shard is synced) is exit 2, one message, nothing left."""
    before = snapshot(shard_dir.parent)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    assert shard(str(data), "--parts", "3", "--out", str(shard_dir), "--force") == 2
    err = capsys.readouterr().err
    assert f"--out: writing the shard to {shard_dir} failed: {os.strerror(errno.ENOSPC)}" in err
    assert "nothing was changed" in err and len(err.strip().splitlines()) == 1
    monkeypatch.undo()
    assert snapshot(shard_dir.parent) == before
    assert_intact_shard(shard_dir, 2)


@pytest.mark.parametrize("extra", [[], ["--balance", "tokens"], ["--val-size", "10"]])
def test_more_parts_than_samples_is_refused_before_any_part_is_written(tmp_path, data, extra, capsys):
    """Before: 5000 empty part files for 3000 samples; 100000 parts: EMFILE traceback with ~20k files left."""
    out = tmp_path / "new" / "deeper" / "S"
    assert shard(str(data), "--parts", "100000", "--out", str(out), *extra) == 2
    samples = 50 if "--val-size" in extra else 60
    assert f"{samples} samples cannot fill 100000 parts" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nor the parents made for it


def test_more_parts_than_samples_over_a_shard_keeps_it(shard_dir, data):
    before = snapshot(shard_dir.parent)
    assert shard(str(data), "--parts", "61", "--out", str(shard_dir), "--force") == 2
    assert snapshot(shard_dir.parent) == before


def test_a_part_count_past_the_open_file_limit_is_one_message(tmp_path, data, monkeypatch, capsys):
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (64, 64))
    out = tmp_path / "S"
    assert shard(str(data), "--parts", "40", "--out", str(out)) == 2
    assert "--parts 40: writing the parts keeps 40 files open" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["in"]


def test_out_a_file_or_below_a_file_is_one_message(tmp_path, data, capsys):
    """Before: FileExistsError / NotADirectoryError tracebacks."""
    (tmp_path / "f").write_text("a file")
    before = snapshot(tmp_path)
    done = shard_subprocess(tmp_path, str(data), "--parts", "2", "--out", "f")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"--out: {tmp_path / 'f'} is a file, not a directory" in done.stderr
    assert shard(str(data), "--parts", "2", "--out", str(tmp_path / "f" / "x" / "y")) == 2
    assert f"lies below {tmp_path / 'f'}, which is a file" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_the_current_directory_cannot_be_replaced(tmp_path, data, monkeypatch, capsys):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert shard(str(data), "--parts", "2", "--out", ".") == 2
    assert "is the current directory" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["here", "in"] and not os.listdir(here)


def test_force_replaces_the_shard_with_exactly_the_new_parts(shard_dir, tmp_path, data):
    """Happy path: 4 parts, then 2 with --force (before: part_02/03 stayed); an empty --out is taken too."""
    assert shard(str(data), "--parts", "4", "--out", str(shard_dir), "--force") == 0
    assert sorted(os.listdir(shard_dir)) == [MANIFEST, "part_00.jsonl", "part_01.jsonl", "part_02.jsonl",
                                             "part_03.jsonl"]
    assert shard(str(data), "--parts", "2", "--out", str(shard_dir), "--force", "--val-size", "10") == 0
    assert sorted(os.listdir(shard_dir)) == [MANIFEST, "part_00.jsonl", "part_01.jsonl", "val.jsonl"]
    assert_intact_shard(shard_dir, 2)
    assert json.loads((shard_dir / MANIFEST).read_text())[SHARD_MARKER] == 1
    assert sorted(os.listdir(shard_dir.parent)) == ["S"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert shard(str(data), "--parts", "3", "--out", str(empty)) == 0
    assert_intact_shard(empty, 3)


def test_a_shard_written_before_the_marker_is_still_ours(shard_dir, tmp_path, data):
    """An older manifest (no marker) with its quarantine (rows were skipped) is replaced, its files removed."""
    manifest = json.loads((shard_dir / MANIFEST).read_text())
    del manifest[SHARD_MARKER]
    manifest["bad_rows"] = {"invalid_json": 1}
    (shard_dir / MANIFEST).write_text(json.dumps(manifest))
    (shard_dir / QUARANTINE).write_text("{}\n")
    assert shard(str(data), "--parts", "3", "--out", str(shard_dir), "--force") == 0
    assert sorted(os.listdir(shard_dir)) == [MANIFEST, "part_00.jsonl", "part_01.jsonl", "part_02.jsonl"]


def test_help_shows_the_plain_balance_values(capsys):
    with pytest.raises(SystemExit):
        shard("--help")
    out = capsys.readouterr().out
    assert "{samples,tokens}" in out and "ShardBalance" not in out


@pytest.mark.slow
def test_a_store_prefix_is_ours_only_with_our_manifest_and_force_leaves_exactly_the_new_parts(s3_server, data,
                                                                                             tmp_path, capsys):
    """`--out s3://...`: part objects without our manifest are someone's (before: taken and overwritten); 4 parts then
    2 with --force leave exactly the new shard's objects (before: part_02/03 stayed)."""
    from dsrecipes.data.sources.remote import s3

    fs = s3()
    fs.mkdir("s3://dsr-hostile")
    fs.pipe_file("s3://dsr-hostile/theirs/part_00.jsonl", b"mine")
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    assert shard(str(data), "--parts", "2", "--out", "s3://dsr-hostile/theirs", "--force", cache) == 2
    assert "holds 'part_00.jsonl', which shard does not write" in capsys.readouterr().err
    assert fs.cat_file("s3://dsr-hostile/theirs/part_00.jsonl") == b"mine"
    assert shard(str(data), "--parts", "4", "--out", "s3://dsr-hostile/ours", cache) == 0
    assert shard(str(data), "--parts", "2", "--out", "s3://dsr-hostile/ours", "--force", cache) == 0
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("s3://dsr-hostile/ours", refresh=True))
    assert names == [MANIFEST, "part_00.jsonl", "part_01.jsonl"]
    assert_intact_shard("s3://dsr-hostile/ours", 2)
    assert not [p for p in (tmp_path / "cache").iterdir() if "shard" in p.name]  # staging removed


def test_an_out_url_with_credentials_or_another_scheme_is_refused_without_echoing_them(data, capsys):
    """--out s3://KEY:SECRET@bucket/x used to reach the store client, whose error printed the secret back."""
    assert shard("--parts", "1", "--out", "s3://AKIAUSER:topsecretpw@bucket/x", f"dataset.paths=[{data}]") == 2
    err = capsys.readouterr().err
    assert "--out: s3://...: a data URL must not carry credentials" in err and "topsecretpw" not in err
    assert shard("--parts", "1", "--out", "gs://bucket/x", f"dataset.paths=[{data}]") == 2
    assert "--out: 'gs://bucket/x': scheme gs:// is not read" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["a FIFO", "a directory"])
def test_a_part_replaced_by_a_fifo_or_directory_says_what_it_is(shard_dir, kind):
    """A shard part that is now a FIFO or a directory. Was: 'part_01.jsonl: missing (listed in manifest.json)', as
    if nothing were there; now it says what is there, naming the path (and never opens the FIFO)."""
    from dsrecipes.core.errors import DataError

    part = shard_dir / "part_01.jsonl"
    part.unlink()
    if kind == "a FIFO":
        os.mkfifo(part)
    else:
        part.mkdir()
    manifest = read_manifest(str(shard_dir), world_size=2)
    verify_part(manifest, 0)
    with pytest.raises(DataError) as refused:
        verify_part(manifest, 1)
    assert str(refused.value).startswith(f"{part}: is not a regular file ({kind}), where {MANIFEST} lists a shard part")
    part.rmdir() if part.is_dir() else part.unlink()
    with pytest.raises(DataError, match=r"part_01.jsonl: missing \(listed in manifest.json\)"):
        verify_part(manifest, 1)  # nothing there at all is still 'missing'
