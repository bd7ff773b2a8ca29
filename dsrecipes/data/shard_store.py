"""`dsrecipes shard --out s3://bucket/prefix`: parts and manifest written to a store, and read back from it.

The parts are written as for a local `--out` into a staging directory under the data cache (this process creates
and removes it), then uploaded part by part; the manifest goes last, with each uploaded part's identity (ETag,
`remote.identity`), so a prefix with a manifest always holds the parts it lists, and a presharded rank checks its
part by that identity (one HEAD) instead of reading it twice. A prefix holding objects that `shard` does not write is
a user's and is refused, as a non-empty local directory is; an existing manifest needs `--force`.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from dsrecipes.data.cache import cache_root
from dsrecipes.data.sources.remote import identity, s3, store_errors
from dsrecipes.errors import UserError
from dsrecipes.fileio import json_text

MANIFEST = "manifest.json"


def exists(url: str) -> bool:
    with store_errors(url):
        return bool(s3().exists(url))


def read_text(url: str) -> str:
    with store_errors(url):
        return s3().cat_file(url).decode("utf-8")


def identity_or_none(url: str) -> Optional[str]:
    fs = s3()
    with store_errors(url):
        try:
            return identity(url, fs.info(url))
        except FileNotFoundError:
            return None


def shard_to_store(cfg: Any, parts: int, out_url: str, balance: Any, force: bool,
                   local_shard: Callable[..., Any], val_size: float = 0) -> Any:
    """`local_shard` (shard.shard) into a staging directory, then the parts and the manifest uploaded to `out_url`."""

    prefix = out_url.rstrip("/")
    fs = s3()
    with store_errors(out_url):
        names = [p.rsplit("/", 1)[-1] for p in fs.ls(prefix, refresh=True)] if fs.exists(prefix) else []
    if MANIFEST in names and not force:
        raise UserError(f"{prefix}/{MANIFEST} exists; choose another --out or pass --force to overwrite")
    foreign = [n for n in names if not (n in (MANIFEST, "quarantine.jsonl", "val.jsonl") or re.fullmatch(r"part_\d+\.jsonl", n))]
    if foreign:
        raise UserError(f"--out: {prefix} holds {foreign[0]!r}, which shard does not write; shard writes into a new "
                        "or empty prefix (or over an earlier shard prefix with --force). Nothing was changed")
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
        manifest.directory = prefix
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # created above by this process
