"""Shared fixtures: compose through the one real road (`compose` + `load_config`), tiny assets, markers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def make_cfg() -> Callable[..., object]:
    """make_cfg("data=iterable", "trainer.max_steps=3", check_files=False) -> TrainConfig."""
    from dsrecipes.config.load import compose_and_load

    def _make(*overrides: str, check_files: bool = True):
        return compose_and_load(list(overrides), check_files=check_files)

    return _make


@pytest.fixture
def glaive() -> Path:
    """The real Glaive tool-call demo files (English, Chinese) bundled with dsrecipes."""
    from dsrecipes.paths import ASSETS_DIR

    return ASSETS_DIR / "glaive_toolcall"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a local HF directory (scripts/fetch_smollm2.py; scripts/test.sh runs it first and
    sets DSRECIPES_REQUIRE_SMOLLM2=1, so CI fails instead of skipping when it is missing)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fetch_smollm2", REPO / "scripts" / "fetch_smollm2.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    path = fetch.default_dir()
    if not fetch.is_ready(path):
        message = f"SmolLM2 is not at {path}: run `python scripts/fetch_smollm2.py` (downloads ~93 MB once)"
        if os.environ.get("DSRECIPES_REQUIRE_SMOLLM2") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def subprocess_env(extra: dict | None = None) -> dict:
    """Environment for real subprocess runs: no inherited rank variables, quiet tokenizers, single-thread BLAS."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-API server (moto's standalone server on 127.0.0.1) for the whole session; this process's
    environment points at it (AWS_ENDPOINT_URL, fake credentials) until the session ends."""
    from tests.helpers.s3server import S3Server

    server = S3Server().start()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env().items():
            mp.setenv(key, value)
        yield server
    server.stop()
