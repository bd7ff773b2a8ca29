"""Output paths a user names that lead nowhere: a symbolic link whose target does not exist, at the path or above it.

Making such a path makes the link's target, a place the user never named (`shard --out LINK` created the target
directory and wrote the shard there, `export --out LINK` the model, a run its run directory; `inspect-data --run-dir
LINK/x` and `pipeline --out LINK/x` looped into a RecursionError). Each is now one message naming the link, exit 2,
and nothing is created (core/fileio.py `dangling_link_problem`, used by every output check).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict

import pytest

from dsrecipes.core.errors import UserError
from dsrecipes.core.paths import SAMPLE_DATA_DIR
from dsrecipes.core.rundir import claim, claim_marked_dir
from dsrecipes.run.preflight import writable_dir
from tests.conftest import in_process_environ

DANGLING = "a symbolic link to"


def snapshot(root: Path) -> Dict[str, str]:
    return {p.relative_to(root).as_posix(): os.readlink(p) if p.is_symlink() else "d" if p.is_dir() else "f"
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def link(tmp_path) -> Path:
    """`tmp_path/out` -> `tmp_path/elsewhere/target`; `elsewhere` exists, `target` does not."""
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere" / "target", tmp_path / "out")
    return tmp_path / "out"


def main(*argv: str) -> int:
    from dsrecipes.cli import main as cli

    with in_process_environ():
        return cli(list(argv))


@pytest.mark.parametrize("below", [False, True], ids=["the-link", "below-the-link"])
def test_shard_out_a_dangling_link_is_refused_and_creates_nothing(tmp_path, link, below, capsys):
    """Before: exit 0, the shard written into elsewhere/target (created through the link)."""
    before = snapshot(tmp_path)
    out = link / "sub" if below else link
    data = str(SAMPLE_DATA_DIR / "train.jsonl")
    assert main("shard", data, "--parts", "2", "--out", str(out), "dataset.max_samples=8") == 2
    err = capsys.readouterr().err
    assert f"--out: {out}" in err and f"{DANGLING} {tmp_path / 'elsewhere' / 'target'}, which does not exist" in err
    assert snapshot(tmp_path) == before


def test_export_out_a_dangling_link_is_refused_before_any_work(tmp_path, link, capsys):
    """Before: the export was written into elsewhere/target. The link is named before the run is even looked at."""
    before = snapshot(tmp_path)
    assert main("export", str(tmp_path / "no-run"), "--out", str(link)) == 2
    assert f"--out: {link} is {DANGLING}" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_score_out_below_a_dangling_link_or_a_file_is_refused_before_scoring(tmp_path, link, monkeypatch, capsys):
    """Before: the model was loaded and every pair scored, then FileExistsError / NotADirectoryError tracebacks."""
    import dsrecipes.commands.score as score

    monkeypatch.setattr(score, "check_model_dir", lambda path: None)
    monkeypatch.setattr(score, "read_pairs", lambda path: pytest.fail("read the pairs before checking --out"))
    (tmp_path / "file").write_text("user data")
    before = snapshot(tmp_path)
    for out, expected in ((link / "r.jsonl", f"{link} is {DANGLING}"), (tmp_path / "file" / "r.jsonl", "is a file")):
        assert main("score", str(tmp_path), "--pairs", "p.jsonl", "--out", str(out)) == 2
        assert expected in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_prompt_eval_json_below_a_dangling_link_is_refused_before_answering(tmp_path, link):
    """Before: accepted up front; after every answer was generated, 'cannot write ... (File exists)'."""
    from dsrecipes.serve.prompt_eval import check_json_out

    with pytest.raises(UserError, match=f"--json: {link} is {DANGLING}"):
        check_json_out(str(link / "scores.json"))


@pytest.mark.parametrize("below", [False, True], ids=["the-link", "below-the-link"])
def test_marked_dirs_of_inspect_data_and_pipeline_refuse_a_dangling_link(tmp_path, link, below):
    """Before: `--run-dir LINK` was 'not writable (No such file or directory)', `--run-dir LINK/x` (and pipeline
    --out LINK/x) a RecursionError traceback (make_dir's FileExistsError retried ensure_owned_dir for ever)."""
    before = snapshot(tmp_path)
    out = link / "x" if below else link
    with pytest.raises(UserError, match=f"--out: {out} .*{DANGLING}"):
        claim_marked_dir(out, "--out", "dsrecipes_pipeline.json", "a dsrecipes pipeline directory")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("below", [False, True], ids=["the-link", "below-the-link"])
def test_a_run_directory_behind_a_dangling_link_is_refused(tmp_path, link, below):
    """trainer.output_dir (preflight, before Hydra or a claim writes anything) and the claim itself. Before: the run
    made elsewhere/target and wrote its locks and .hydra/ there (and a claim of LINK/x recursed without end)."""
    before = snapshot(tmp_path)
    out = link / "x" if below else link
    problems = writable_dir("trainer.output_dir", out)
    assert len(problems) == 1 and problems[0].startswith(f"trainer.output_dir: {out} ") and DANGLING in problems[0]
    with pytest.raises(UserError, match=DANGLING):
        claim(out, "trainer.output_dir", "fingerprint")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("setting", ["hydra.run.dir", "hydra.sweep.dir"])
def test_hydra_run_and_sweep_dirs_behind_a_dangling_link_are_refused(tmp_path, link, setting, capsys):
    """Before: the run (or the sweep) resolved the link, made its target and wrote locks and .hydra/ there."""
    before = snapshot(tmp_path)
    sweep = ["-m", "optimizer.lr=0.001,0.002"] if setting == "hydra.sweep.dir" else []
    assert main("train", *sweep, f"{setting}={link}", "trainer.max_steps=1", "dataset.max_samples=80") == 2
    assert f"{setting}: {link} is {DANGLING}" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_a_cache_dir_behind_a_dangling_link_is_named_as_one(tmp_path, link, capsys):
    """inspect-data and audit (no train preflight) said 'data.cache_dir: cannot create LINK (File exists)'."""
    import json

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
    before = snapshot(tmp_path)
    assert main("inspect-data", f"data.cache_dir={link}", f"dataset.paths=[{rows}]", "dataset.val_size=0") == 2
    assert f"lies below {link}, which is {DANGLING}" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["file", "below-a-file", "dangling-link"])
def test_an_nvme_path_deepspeed_cannot_make_is_refused_by_validate(tmp_path, link, kind, capsys):
    """offload.nvme_path was never looked at: every rank failed in DeepSpeed's os.makedirs (after building its ops),
    and through a dangling link made the link's target."""
    (tmp_path / "file").write_text("user data")
    path = {"file": tmp_path / "file", "below-a-file": tmp_path / "file" / "swap", "dangling-link": link}[kind]
    before = snapshot(tmp_path)
    assert main("validate", "zero=stage3", "offload=nvme", f"offload.nvme_path={path}") == 2
    said = capsys.readouterr().err
    assert f"offload.nvme_path: {path}" in said and ("is a file" in said or DANGLING in said)
    assert snapshot(tmp_path) == before


def test_dangling_link_finds_loops_and_leaves_good_links(tmp_path, link):
    from dsrecipes.core.fileio import dangling_link

    os.symlink(tmp_path / "loop", tmp_path / "loop")
    os.symlink(tmp_path / "elsewhere", tmp_path / "good")
    assert dangling_link(tmp_path / "loop" / "a") == tmp_path / "loop"
    assert dangling_link(link / "a" / "b") == link
    assert dangling_link(tmp_path / "good" / "new") is None and dangling_link(tmp_path / "new") is None
    assert writable_dir("k", tmp_path / "good" / "new") == []


# ---------------------------------------------------------------------------------------------------------------
# What validate refuses about data.shard_dir and model.path is what a run refuses, in the same words


def _shard_dir(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        path.write_text("a file")
    else:
        path.mkdir()
        text = {"not-json": "{x", "a-list": "[1]", "unknown-key": '{"version": 1, "colour": 1}',
                "bad-parts": '{"version": 1, "parts": "2", "balance": "samples", "files": [], "counts": [], '
                             '"sha256": []}'}[kind]
        (path / "manifest.json").write_text(text)
    return path


SHARD_MESSAGES = {"fifo": "is a FIFO, not a directory", "file": "is a file, not a directory",
                  "not-json": "(not JSON: ", "a-list": "(not a JSON object)", "unknown-key": "(unknown keys colour)",
                  "bad-parts": "(parts: '2' is not a whole number >= 1)"}


@pytest.mark.parametrize("kind", list(SHARD_MESSAGES))
def test_validate_refuses_a_shard_dir_as_the_run_does(tmp_path, kind, capsys):
    """Before: validate said OK for a FIFO or a file as data.shard_dir (the run: 'manifest.json not found'), and for a
    manifest.json that is not JSON or not an object the run was a JSONDecodeError / TypeError traceback."""
    path = _shard_dir(tmp_path, kind)
    overrides = ["data=presharded", f"data.shard_dir={path}"]
    assert main("validate", *overrides) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert SHARD_MESSAGES[kind] in said and "Traceback" not in said
    assert main("train", *overrides, f"trainer.output_dir={tmp_path / 'run'}") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == said
    assert not (tmp_path / "run").exists()


def test_a_presharded_run_reading_a_broken_manifest_is_one_message(tmp_path):
    """The run's own read (data/strategies/presharded.py) past the config checks: one DataError, not a traceback."""
    from dsrecipes.core.errors import DataError
    from dsrecipes.data.shard.manifest import read_manifest

    for kind in ("not-json", "a-list", "unknown-key", "bad-parts", "fifo"):
        with pytest.raises(DataError, match=re.escape(SHARD_MESSAGES[kind])):
            read_manifest(str(_shard_dir(tmp_path, kind)), world_size=2)


def test_validate_refuses_a_model_dir_whose_config_is_not_json_as_the_run_does(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{x")
    assert main("validate", f"model.path={tmp_path / 'm'}") == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith(f"error: model.path: {tmp_path / 'm' / 'config.json'} is unreadable")
    assert main("train", f"model.path={tmp_path / 'm'}", f"trainer.output_dir={tmp_path / 'run'}") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == said
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key, name", [("model.path", "model.safetensors"), ("model.tokenizer_path", "tokenizer.json"),
                                       ("model.tokenizer_path", "tokenizer_config.json")])
def test_a_fifo_in_a_model_or_tokenizer_dir_is_refused_not_read(tmp_path, key, name, capsys):
    """Before: validate (and train's preflight) opened the FIFO - the weights' header check, the template check's
    tokenizer_config.json - and blocked for ever."""
    import shutil

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    model = tmp_path / "m"
    shutil.copytree(TINY_TOKENIZER_DIR, model)
    (model / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"")
    (model / name).unlink(missing_ok=True)
    os.mkfifo(model / name)
    assert main("validate", f"{key}={model}") == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == f"error: {key}: {model / name} is a FIFO, not a regular file; loading would read it (a FIFO " \
                   "blocks for ever). Replace it with the file, or give another directory"
    assert main("train", f"{key}={model}", f"trainer.output_dir={tmp_path / 'run'}") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == said
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(60)
def test_score_refuses_a_fifo_in_the_export_instead_of_hanging(tmp_path, capsys):
    """Before: `dsrecipes score DIR` with a FIFO tokenizer_config.json blocked for ever (the custom-code check read it)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", "num_labels": 1}')
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    os.mkfifo(tmp_path / "m" / "tokenizer_config.json")
    assert main("score", str(tmp_path / "m"), "--pairs", "p.jsonl", "--out", str(tmp_path / "r.jsonl")) == 2
    assert f"EXPORT: {tmp_path / 'm' / 'tokenizer_config.json'} is a FIFO" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_fifo_as_a_checkpoints_complete_json_is_damage_not_a_hang(tmp_path):
    """Before: export and a resumed run read complete.json of each checkpoint and blocked for ever on a FIFO."""
    from dsrecipes.boundary.checkpoint_find import damage
    from dsrecipes.core.checkpoint_names import commit_order, read_record

    tag = tmp_path / "checkpoints" / "step_3"
    tag.mkdir(parents=True)
    os.mkfifo(tag / "complete.json")
    with pytest.raises(ValueError, match="not a regular file"):
        read_record(tag)
    assert damage(tag) == "complete.json: unreadable (not a regular file)"
    commit_order(tag)  # (sorting checkpoints reads the record too)


@pytest.mark.timeout(60)
def test_a_fifo_where_our_marker_belongs_is_refused_not_waited_on(tmp_path):
    """Before: a run, pipeline --out and inspect-data --run-dir read the marker of the directory they were given and
    blocked for ever on a FIFO planted under its name."""
    from dsrecipes.core.rundir import MARKER_FILE

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / MARKER_FILE)
    with pytest.raises(UserError, match="is unreadable \\(not a regular file\\)"):
        claim(run, "trainer.output_dir", "fingerprint")
    other = tmp_path / "pipe"
    other.mkdir()
    os.mkfifo(other / "dsrecipes_pipeline.json")
    with pytest.raises(UserError, match="is not our marker"):
        claim_marked_dir(other, "--out", "dsrecipes_pipeline.json", "a dsrecipes pipeline directory")


@pytest.mark.timeout(60)
def test_shard_force_over_a_fifo_named_manifest_json_is_refused_not_waited_on(tmp_path, capsys):
    """Before: `shard --out DIR --force` read DIR/manifest.json to see whether the directory was ours, and blocked for
    ever on a FIFO of that name."""
    (tmp_path / "S").mkdir()
    os.mkfifo(tmp_path / "S" / "manifest.json")
    data = str(SAMPLE_DATA_DIR / "train.jsonl")
    assert main("shard", data, "--parts", "2", "--out", str(tmp_path / "S"), "--force", "dataset.max_samples=8") == 2
    assert "holds no manifest.json written by `dsrecipes shard`" in capsys.readouterr().err
