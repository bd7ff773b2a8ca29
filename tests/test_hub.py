"""Hub ids in model.path: resolved once by the launching process from a local hub cache (offline, no network in
tests), written into the run directory as a local snapshot path; missing cache + no network -> exit 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import subprocess_env

REPO_ID = "acme/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate_hub_cache(hf_home: Path, model_dir: Path, repo_id: str = REPO_ID, commit: str = COMMIT) -> Path:
    """The layout `huggingface_hub` writes: refs/main -> commit, snapshots/<commit>/<files> (blobs elsewhere)."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    blobs = repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(p for p in model_dir.iterdir() if p.is_file())):
        blob = blobs / f"{i:040x}"
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.rank.export import export_initial

    cfg = compose_and_load(["debug=fast"])
    return export_initial(cfg, load_tokenizer(cfg), tmp_path_factory.mktemp("hub_src") / "tiny")


def dsr(*args, cwd, env):
    return subprocess.run([sys.executable, "-m", "dsrecipes", *args], capture_output=True, text=True, cwd=cwd,
                          env=subprocess_env(env), timeout=600)


def test_hub_id_from_a_local_cache_offline_becomes_a_local_snapshot_in_the_run_dir(tmp_path, tiny_model_dir):
    snapshot = populate_hub_cache(tmp_path / "hf", tiny_model_dir)
    run = tmp_path / "run"
    out = dsr(f"model.path={REPO_ID}", "debug=fast", "launcher.dry_run=true", f"trainer.output_dir={run}",
              f"hydra.run.dir={run}", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path,
              env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    model = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert Path(model["path"]) == snapshot and model["revision"] == COMMIT
    assert model["name"] == REPO_ID  # named after the hub id, not "tiny" and not the commit directory
    assert f"model.path: {REPO_ID} -> {snapshot}" in out.stderr
    assert "template: auto -> tokenizer" in out.stderr  # the model's own chat template


def test_missing_cache_offline_or_unreachable_hub_is_one_message(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants as hub_constants

    from dsrecipes.cli import main

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [f"trainer.output_dir={tmp_path / 'run'}", "launcher.dry_run=true", "debug=fast"]
    assert main(["validate", "model.path=acme/not-cached"]) == 2
    assert "HF_HUB_OFFLINE is set while the hub cache has no copy" in capsys.readouterr().err
    assert main(["model.path=acme/not-cached", *args]) == 2
    err = capsys.readouterr().err
    assert "model.path: 'acme/not-cached' is not a local directory, and HF_HUB_OFFLINE is set" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()  # nothing half written
    # Online but the Hub unreachable (a closed local port stands in for "no network").
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub_constants, "HF_HUB_ETAG_TIMEOUT", 2)
    from dsrecipes.core.errors import ConfigError
    from dsrecipes.core.hub import fetch

    with pytest.raises(ConfigError, match="not in the hub cache and the Hub could not be reached"):
        fetch("acme/not-cached", None, "model.path")


def test_local_paths_win_and_revisions_are_honoured(tmp_path, tiny_model_dir, monkeypatch):
    import huggingface_hub.constants as hub_constants

    from dsrecipes.core.errors import ConfigError
    from dsrecipes.core.hub import fetch, is_hub_id

    populate_hub_cache(tmp_path / "hf", tiny_model_dir)
    other = populate_hub_cache(tmp_path / "hf2", tiny_model_dir, commit="f" * 40)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch(REPO_ID, COMMIT, "model.path").endswith(COMMIT)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE"):
        fetch(REPO_ID, "v2.0", "model.path")  # a revision the cache does not hold
    monkeypatch.chdir(other.parents[3])  # "hub" now also exists as a local directory here
    (Path("acme")).mkdir()
    (Path("acme") / "tiny-chat").mkdir()
    assert not is_hub_id(REPO_ID) and is_hub_id("acme/elsewhere") and not is_hub_id("/abs/path")
    assert not is_hub_id("./acme/x") and not is_hub_id("a/b/c")
