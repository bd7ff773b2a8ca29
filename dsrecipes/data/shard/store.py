"""`dsrecipes shard --out s3://bucket/prefix`: parts and manifest written to a store, and read back from it.

The parts are written as for a local `--out` into a staging directory under the data cache (this process creates
and removes it), then uploaded part by part; the manifest goes last, with each uploaded part's identity (ETag,
`remote.identity`), so a prefix with a manifest always holds the parts it lists, and a presharded rank checks its
part by that identity (one HEAD) instead of reading it twice. A prefix is ours only when it holds our manifest
(`shard.shard_files`), and then only the objects it lists: anything else there is a user's and is refused, as in a
non-empty local directory; an existing manifest needs `--force`. A store has no atomic swap: under `--force` the old
manifest is removed first (so its parts are never described while they are replaced), the new one goes last, and the
old shard's objects the new one does not list (parts of a larger count) are removed after it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, List, Optional

from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import json_text, loads_bounded
from dsrecipes.data.prepare.cache import cache_root
from dsrecipes.data.sources.remote import identity, s3, store_errors

MANIFEST = "manifest.json"


def exists(url: str) -> bool:
    with store_errors(url):
        return bool(s3().exists(url))


def read_text(url: str) -> str:
    with store_errors(url):
        return s3().cat_file(url).decode("utf-8")


def json_or_none(url: str) -> Any:
    """The JSON object at `url`, or None when it is not JSON."""
    try:
        return loads_bounded(read_text(url), "nested too deeply")  # a RecursionError is not JSON either
    except ValueError:
        return None


def identity_or_none(url: str) -> Optional[str]:
    fs = s3()
    with store_errors(url):
        try:
            return identity(url, fs.info(url))
        except FileNotFoundError:
            return None


def shard_to_store(cfg: Any, parts: int, out_url: str, balance: Any, force: bool, local_shard: Callable[..., Any],
                   shard_files: Callable[[Any], Optional[List[str]]], val_size: float = 0) -> Any:
    """`local_shard` (shard.shard) into a staging directory, then the parts and the manifest uploaded to `out_url`;
    `shard_files` (shard.shard_files) says which objects a manifest there makes ours."""
    prefix = out_url.rstrip("/")
    fs = s3()
    with store_errors(out_url):
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(prefix, refresh=True)] if fs.exists(prefix) else []
    listed = shard_files(json_or_none(f"{prefix}/{MANIFEST}")) if MANIFEST in names else None
    foreign = [n for n in names if n not in (listed or [])]
    if foreign:
        raise UserError(f"--out: {prefix} holds {foreign[0]!r}, which shard does not write (no {MANIFEST} of a "
                        "`dsrecipes shard` there lists it); shard writes into a new or empty prefix (or over an "
                        "earlier shard prefix with --force). Nothing was changed")
    if listed is not None and not force:
        raise UserError(f"{prefix}/{MANIFEST} exists; choose another --out or pass --force to overwrite")
    root = cache_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="shard-staging-", dir=root))
    try:
        manifest = local_shard(cfg, parts, str(staging), balance, val_size=val_size)
        with store_errors(out_url):
            if MANIFEST in names:
                fs.rm_file(f"{prefix}/{MANIFEST}")  # the old parts are not described while they are replaced
            for name in manifest.files:
                fs.put_file(str(staging / name), f"{prefix}/{name}")
            manifest.identities = [identity(f"{prefix}/{n}", fs.info(f"{prefix}/{n}", refresh=True))
                                   for n in manifest.files]
            if manifest.val_file:  # the validation part (`--val-size`), checked by ranks through its identity
                fs.put_file(str(staging / manifest.val_file), f"{prefix}/{manifest.val_file}")
                manifest.val_identity = identity(f"{prefix}/{manifest.val_file}",
                                                 fs.info(f"{prefix}/{manifest.val_file}", refresh=True))
            if (staging / "quarantine.jsonl").is_file():
                fs.put_file(str(staging / "quarantine.jsonl"), f"{prefix}/quarantine.jsonl")
            fs.pipe_file(f"{prefix}/{MANIFEST}", json_text(manifest.to_json()).encode())
            kept = set(shard_files(manifest.to_json()) or [])
            for name in [n for n in listed or [] if n not in kept]:  # the old shard's, no longer described
                fs.rm_file(f"{prefix}/{name}")
        manifest.directory = prefix
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # created above by this process
