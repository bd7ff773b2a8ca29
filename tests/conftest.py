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
