"""Hugging Face Hub ids in `model.path` / `model.tokenizer_path`: resolved once, in the launching process.

`model.path=Org/Name` (optionally `model.revision=<branch|tag|commit>`) that is not a local path is fetched with
`huggingface_hub.snapshot_download`, which honours `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE=1` (cache only) and
`HF_TOKEN`. Only what a run needs is fetched (config, tokenizer, chat template, safetensors weights; `*.bin` only for
a repository without safetensors). The launching process writes the local snapshot directory into the run's
config.yaml (and the commit into `model.revision`), so ranks and later commands (export, prompt-eval, chat) read
local files only and every node sees the same revision. Not cached and no network: one message, exit 2.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import List, Optional

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import TrainConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
NEEDED = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
LEGACY_WEIGHTS = ["pytorch_model*.bin"]


def is_hub_id(path: Optional[str]) -> bool:
    """`Org/Name` that is not an existing local path (a local directory always wins)."""
    return bool(path) and _HUB_ID.match(path) is not None and not os.path.exists(os.path.expanduser(path))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cached_snapshot(repo_id: str, revision: Optional[str]) -> Optional[str]:
    """The local snapshot directory of `repo_id` at `revision` when the hub cache holds it, else None (no network)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=NEEDED)
    except Exception:  # LocalEntryNotFoundError and friends: not in the cache
        return None


def fetch(repo_id: str, revision: Optional[str], key: str) -> str:
    """Local snapshot directory of a hub repository (downloaded unless cached or offline); ConfigError otherwise."""
    from huggingface_hub import snapshot_download

    patterns = NEEDED  # no *.py: a model's own code never runs (model.trust_remote_code must stay false)
    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=offline())
        if not any(Path(path).glob("*.safetensors")) and not offline():
            path = snapshot_download(repo_id, revision=revision, allow_patterns=patterns + LEGACY_WEIGHTS)
    except Exception as exc:  # network, auth, unknown repo/revision, not cached while offline
        how = ("HF_HUB_OFFLINE is set and the hub cache has no copy" if offline()
               else "it is not in the hub cache and the Hub could not be reached")
        detail = " ".join(str(exc).split())[:300]
        raise ConfigError(f"{key}: {where!r} is not a local directory, and {how} ({type(exc).__name__}: {detail}). "
                          f"Download it where there is a network (`huggingface-cli download {repo_id}`, same HF_HOME), "
                          "or set the path of a local copy") from None
    return path


def resolve_hub_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with hub ids in model.path / model.tokenizer_path replaced by local snapshot directories (launching
    process only). The model's revision becomes the snapshot's commit, so a resumed run loads the same weights."""
    model = cfg.model
    changes = {}
    if is_hub_id(model.path):
        path = fetch(model.path, model.revision, "model.path")
        changes.update(path=path, revision=Path(path).name)
    if is_hub_id(model.tokenizer_path):
        changes["tokenizer_path"] = fetch(model.tokenizer_path, None, "model.tokenizer_path")
    if not changes:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(model, **changes))


def check_hub_paths(cfg: TrainConfig) -> List[str]:
    """validate(): a hub id that cannot resolve here (offline and not cached). Online, the launch will download it."""
    problems = []
    for key, path, revision in (("model.path", cfg.model.path, cfg.model.revision),
                                ("model.tokenizer_path", cfg.model.tokenizer_path, None)):
        if is_hub_id(path) and offline() and cached_snapshot(path, revision) is None:
            problems.append(f"{key}: {path!r} is not a local directory, and HF_HUB_OFFLINE is set while the hub cache "
                            f"has no copy (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')})")
    return problems
