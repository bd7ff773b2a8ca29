"""`hf://datasets/org/name[@revision]/path` through huggingface_hub's own cache (data/sources/remote.py names the schemes).

The files a pattern names are fetched with `snapshot_download(allow_patterns=[path])` into the Hub cache (with
HF_HUB_OFFLINE=1: taken from the cache only) and returned as local snapshot paths, which every other module reads
as local files. `HfFileSystem` cannot list a repository offline; the cache can. The cache folder is read from the
environment at call time (huggingface_hub reads its constants once, at import).
"""

from __future__ import annotations

import fnmatch
import os
from typing import List

from dsrecipes.core.errors import DataError
from dsrecipes.core.paths import user_cache_dir


def _hub_cache() -> str:
    """huggingface_hub's cache folder from the environment now (its own constants are read once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(user_cache_dir(), "huggingface")
    return os.path.join(home, "hub")


def hf_expand(url: str) -> List[str]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    rest = url[len("hf://datasets/"):]
    org, name_rev, pattern = rest.split("/", 2)
    name, _, revision = name_rev.partition("@")
    repo_id = f"{org}/{name}"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        root = snapshot_download(repo_id, repo_type="dataset", revision=revision or None, allow_patterns=[pattern],
                                 local_files_only=offline, cache_dir=_hub_cache())
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set while the hub cache has no copy" if offline else "not in the cache, hub unreachable"
        raise DataError(f"{url}: dataset {repo_id} {why}; download it once (`hf download {repo_id} "
                        "--repo-type dataset`) or unset HF_HUB_OFFLINE") from None
    except Exception as exc:
        raise DataError(f"{url}: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    found = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if fnmatch.fnmatchcase(rel, pattern) and os.path.isfile(os.path.join(root, rel)):
                found.append(os.path.join(root, rel))
    return sorted(found)
