"""Run directories dsrecipes owns (tracker issue 10): a path the user names is theirs until proven ours.

Real processes and real files, no mocks. Each destructive case builds a directory of foreign files, runs the real
command, and proves every file is still there byte for byte.
  ownership   a foreign `trainer.output_dir` / `hydra.run.dir` is refused; a file, a path below a file, a
              read-only place, an unwritable cache directory are refused before anything is created
  locking     a directory held by another run (a live process holding its lock) or by ranks that outlived their
              launching process is refused, naming the holder; two runs started at once (tests/test_run_safety.py)
  defaults    two default runs started in the same second get two directories
  models      a model directory without config.json or weights, a tokenizer path that is a file, a custom-code
              model: exit 2 from the run and from `dsrecipes validate`, before any rank
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Tuple

import pytest

from tests.conftest import subprocess_env


def snapshot(root: Path) -> Dict[str, bytes]:
    """Every file and directory below `root` with its bytes (directories as b'<dir>')."""
    out = {}
    for path in sorted(root.rglob("*")):
        out[path.relative_to(root).as_posix()] = b"<dir>" if path.is_dir() else path.read_bytes()
    return out


def foreign_dir(root: Path) -> Path:
    """A user's directory that happens to contain names a dsrecipes run would write."""
    root.mkdir(parents=True)
    (root / "export").mkdir()
    (root / "export" / "model.safetensors").write_bytes(b"their weights")
    (root / "checkpoints" / "step_1").mkdir(parents=True)
    (root / "checkpoints" / "step_1" / "notes.txt").write_text("keep me")
    (root / "quarantine.jsonl").write_text('{"mine": true}\n')
    (root / "config.yaml").write_text("their: config\n")
    (root / "loss.png").write_bytes(b"\x89PNG not really")
    return root


def dsrecipes(*args: str, cwd: Path) -> Tuple[int, str]:
    """`dsrecipes ARGS` in this process (the refusals below happen before any rank, so no process is needed):
    (exit code, stdout + stderr)."""
    import contextlib
    import io

    from dsrecipes.cli import main

    out, old = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(list(args))
    finally:
        os.chdir(old)
    return code, out.getvalue()


def error_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out, out[-3000:]
    return lines[0]


FAST = ["debug=fast", "trainer.max_steps=2", "scheduler.warmup_steps=1"]


# ---------------------------------------------------------------------------------------------------------------
# Ownership


@pytest.mark.parametrize("key", ["trainer.output_dir", "hydra.run.dir"])
def test_a_foreign_directory_is_refused_and_left_byte_for_byte(tmp_path, key):
    target = foreign_dir(tmp_path / "theirs")
    before = snapshot(target)
    code, out = dsrecipes(*FAST, f"{key}={target}", cwd=tmp_path)
    assert code == 2
    assert f"{key}: {target} is not empty" in error_line(out) and "not a dsrecipes run directory" in out
    assert snapshot(target) == before


def test_the_current_directory_is_not_a_run_directory(tmp_path):
    target = foreign_dir(tmp_path / "cwd")
    before = snapshot(target)
    code, out = dsrecipes(*FAST, "trainer.output_dir=.", cwd=target)
    assert code == 2 and "is not empty" in error_line(out)
    assert snapshot(target) == before


def test_a_file_and_a_path_below_a_file_are_refused(tmp_path):
    afile = tmp_path / "file.txt"
    afile.write_text("data")
    code, out = dsrecipes(*FAST, f"trainer.output_dir={afile}", cwd=tmp_path)
    assert code == 2 and f"trainer.output_dir: {afile} is a file" in error_line(out)
    code, out = dsrecipes(*FAST, f"trainer.output_dir={afile}/run", cwd=tmp_path)
    assert code == 2 and f"lies below {afile}, which is a file" in error_line(out)
    assert afile.read_text() == "data" and sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write to, root included (root ignores permission bits: a read-only mount)."""
    path = tmp_path / "ro"
    path.mkdir()
    (path / "existing").mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        (path / "existing").chmod(0o555)
        yield path
        path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"running as root without mount permission: no read-only directory ({mounted.stderr!r})")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_unwritable_output_and_cache_directories_are_user_errors(tmp_path, read_only_dir):
    code, out = dsrecipes(*FAST, f"trainer.output_dir={read_only_dir}/run", cwd=tmp_path)
    assert code == 2 and f"trainer.output_dir: {read_only_dir}/run cannot be created" in error_line(out)
    code, out = dsrecipes(*FAST, f"trainer.output_dir={tmp_path}/run", f"data.cache_dir={read_only_dir}/cache",
                          cwd=tmp_path)
    assert code == 2 and f"data.cache_dir: {read_only_dir}/cache cannot be created" in error_line(out)
    assert not (tmp_path / "run").exists()  # refused before the run directory was made
    code, out = dsrecipes("validate", f"trainer.output_dir={read_only_dir}", cwd=tmp_path)
    assert code == 2 and f"trainer.output_dir: {read_only_dir} is not writable" in error_line(out)
    code, out = dsrecipes(*FAST, cwd=read_only_dir)  # a default run directory under a read-only working directory
    assert code == 2 and "hydra.run.dir: cannot create" in error_line(out)


def test_shard_refuses_a_foreign_output_directory(tmp_path):
    from dsrecipes.core.paths import SAMPLE_DATA_DIR

    target = foreign_dir(tmp_path / "theirs")
    before = snapshot(target)
    code, out = dsrecipes("shard", str(SAMPLE_DATA_DIR / "train.jsonl"), "--parts", "2", "--out", str(target),
                          cwd=tmp_path)
    assert code == 2 and f"--out: {target} is not empty" in error_line(out)
    assert snapshot(target) == before


# ---------------------------------------------------------------------------------------------------------------
# Locking


def hold(script: str, tmp_path: Path) -> subprocess.Popen:
    """A real process holding a lock of a run directory until killed; returns once it holds it."""
    ready = tmp_path / f"ready-{time.monotonic_ns()}"
    code = f"{script}\nimport pathlib, time\npathlib.Path({str(ready)!r}).touch()\ntime.sleep(600)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], env=subprocess_env())
    for _ in range(600):
        if ready.exists():
            return proc
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the lock holder did not start")


def test_a_directory_held_by_another_run_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    holder = hold(f"from dsrecipes.core.rundir import claim\nc = claim(__import__('pathlib').Path({str(run)!r}), 'x', 'f')",
                  tmp_path)
    try:
        code, out = dsrecipes(*FAST, f"trainer.output_dir={run}", cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and f"is in use by another run: pid {holder.pid}" in error_line(out)
    assert not (run / "config.yaml").exists()


def test_ranks_that_outlived_their_launching_process_keep_a_new_run_out(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "dsrecipes_run.json").write_text(json.dumps({"dsrecipes_run": 1, "run_id": "x"}))
    orphan = hold(f"from dsrecipes.core.rundir import rank_lock\nl = rank_lock({str(run)!r})", tmp_path)
    try:
        code, out = dsrecipes(*FAST, f"trainer.output_dir={run}", cwd=tmp_path)
    finally:
        orphan.kill()
        orphan.wait()
    assert code == 2 and "ranks of an earlier run" in error_line(out) and str(orphan.pid) in out


@pytest.mark.slow
def test_default_run_directories_are_unique_within_the_same_second(tmp_path):
    argv = [sys.executable, "-m", "dsrecipes", *FAST, "launcher.dry_run=true", f"data.cache_dir={tmp_path / 'cache'}"]
    assert dsrecipes(*argv[3:], "trainer.output_dir=warm", cwd=tmp_path)[0] == 0  # fill the data cache first
    procs = [subprocess.Popen(argv, cwd=tmp_path, env=subprocess_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    dirs = {line.split()[2] for out in outs for line in out.splitlines() if line.startswith("run directory:")}
    assert len(dirs) == 2, outs  # distinct, though named after the same second
    assert len({Path(d).parent for d in dirs}) == 1


# ---------------------------------------------------------------------------------------------------------------
# Models and tokenizers on this machine


def model_dir(tmp_path: Path, kind: str) -> Tuple[Path, str, str]:
    """(path, override, expected message) for a broken local model of `kind`."""
    path = tmp_path / kind
    path.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    if kind == "no_config":
        return path, f"model.path={path}", f"model.path: {path} has no config.json"
    if kind == "no_weights":
        (path / "config.json").write_text(json.dumps(config))
        (path / "tokenizer.json").write_text("{}")
        return path, f"model.path={path}", f"model.path: {path} has no weights"
    if kind == "custom_code":
        (path / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "m.Model"}}))
        (path / "model.safetensors").write_bytes(b"x")
        (path / "tokenizer.json").write_text("{}")
        return path, f"model.path={path}", f"model.path: {path} needs its own Python code to load"
    if kind == "corrupt_weights":  # random bytes where the weights should be: a rank traceback before
        (path / "config.json").write_text(json.dumps(config))
        (path / "tokenizer.json").write_text("{}")
        (path / "model.safetensors").write_bytes(os.urandom(4096))
        return path, f"model.path={path}", f"model.path: {path / 'model.safetensors'} is not a readable safetensors file"
    tokenizer_file = path / "tokenizer.json"
    tokenizer_file.write_text("{}")
    return path, f"model.tokenizer_path={tokenizer_file}", f"model.tokenizer_path: {tokenizer_file} is a file"


@pytest.mark.parametrize("kind", ["no_config", "no_weights", "custom_code", "tokenizer_file", "corrupt_weights"])
def test_broken_model_directories_are_user_errors_in_run_and_validate(tmp_path, kind):
    path, override, message = model_dir(tmp_path, kind)
    code, out = dsrecipes(*FAST, override, f"trainer.output_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert code == 2 and message in error_line(out)
    assert not (tmp_path / "run").exists() and "dsrecipes.rank.worker" not in out  # before any rank, nothing created
    code, out = dsrecipes("validate", override, cwd=tmp_path)
    assert code == 2 and message in error_line(out)


def test_a_run_directory_holding_a_symbolic_link_is_refused_and_appends_never_follow_one(tmp_path):
    """dsrecipes makes no links in a run directory: one planted there (a colleague's run continued in place) would
    make the run append its log to a file elsewhere. The claim refuses it, naming the link; the appending opens
    themselves (fileio.open_append) refuse a link too."""
    from dsrecipes.core.errors import UserError
    from dsrecipes.core.fileio import open_append
    from dsrecipes.core.rundir import claim

    run, outside = tmp_path / "run", tmp_path / "outside.txt"
    outside.write_text("theirs\n")
    claim(run, "trainer.output_dir", "fp").release()
    (run / "logs").mkdir()
    (run / "logs" / "main.log").symlink_to(outside)
    with pytest.raises(UserError, match=r"logs/main.log is a symbolic link \(to .*outside.txt\)"):
        claim(run, "trainer.output_dir", "fp")
    with pytest.raises(OSError):
        open_append(run / "logs" / "main.log")
    assert outside.read_text() == "theirs\n"


def test_an_undone_claim_takes_back_only_what_it_made(tmp_path):
    """A run refused after its claim (commands/train.py: the resume decision) leaves no directory behind: the claim
    removes its marker, its lock files and the directories it created, but never a directory that holds anything
    else, nor one that was there before."""
    from dsrecipes.core.rundir import claim

    held = claim(tmp_path / "a" / "b" / "run", "trainer.output_dir", "fp")
    held.undo()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    held = claim(tmp_path / "mine" / "new" / "run", "trainer.output_dir", "fp")
    (tmp_path / "mine" / "new" / "theirs.txt").write_text("y")  # appeared meanwhile: not ours to remove
    held.undo()
    assert sorted(p.name for p in (tmp_path / "mine" / "new").iterdir()) == ["theirs.txt"]
    old = claim(tmp_path / "old", "trainer.output_dir", "fp")
    old.release()
    again = claim(tmp_path / "old", "trainer.output_dir", "fp")  # an existing run of ours: not fresh
    again.undo()
    assert (tmp_path / "old" / "dsrecipes_run.json").is_file()
