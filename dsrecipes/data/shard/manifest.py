"""A shard directory's manifest (`manifest.json`): what `dsrecipes shard` wrote and what a presharded run trusts.

Owns: the `Manifest` record (per-part counts, token totals, sha256 checksums, balance, row format, sources, bad rows,
the validation part, the ownership marker), reading it back (`read_manifest`, refusing another version or a part
count that differs from the world size), which files a manifest makes ours (`shard_files`: only these are ever
replaced or removed), verifying a part against it (`verify_part`, `verify_val_part`: sha256 locally, the ETag in a
store), and what the rows were checked with (`check_identity`, `checked_alike`). Writing parts: data/shard/build.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import dsrecipes.data.shard.store as store_upload
from dsrecipes.core.errors import DataError, Refused
from dsrecipes.core.fileio import Unreadable, loads_bounded, not_regular, read_json_file
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.prepare.cache import tokenizer_fingerprint
from dsrecipes.data.render.template_choice import choose_template
from dsrecipes.data.shard.rows import PAIR_ROW_FORMAT, PROMPT_ROW_FORMAT, ROW_FORMAT, row_format
from dsrecipes.data.sources.remote import is_url

MANIFEST = "manifest.json"
VAL_PART = "val.jsonl"
QUARANTINE = "quarantine.jsonl"
MANIFEST_VERSION = 1
SHARD_MARKER = "dsrecipes_shard"  # the manifest key that says `dsrecipes shard` wrote it (older manifests lack it)



@dataclass
class Manifest:
    parts: int
    balance: str
    files: List[str]
    counts: List[int]
    sha256: List[str]
    tokens: Optional[List[int]] = None
    sources: List[Dict[str, Any]] = field(default_factory=list)
    bad_rows: Dict[str, int] = field(default_factory=dict)
    bad_rows_by_file: Dict[str, Dict[str, int]] = field(default_factory=dict)
    checked_with: Dict[str, Any] = field(default_factory=dict)  # check_identity() of the shard run
    val_file: Optional[str] = None  # the validation part (`shard --val-size`), not read for training
    val_count: int = 0
    val_sha256: Optional[str] = None
    identities: List[str] = field(default_factory=list)  # parts in a store: remote.identity (ETag) of each
    val_identity: Optional[str] = None  # the validation part in a store: its remote.identity
    row_format: str = ROW_FORMAT
    no_reference: Optional[int] = None  # prompt rows of the training parts without a reference answer (other kinds,
    # and shards written before it: None, not counted)
    # what `dsrecipes shard` was given besides --out and --force (INPUT files absolute): `rebuild_command` repeats it
    shard_args: List[str] = field(default_factory=list)
    version: int = MANIFEST_VERSION
    dsrecipes_shard: int = 1  # SHARD_MARKER: the ownership marker (`shard_files`)
    directory: str = ""  # where it was read from (not stored)

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def fingerprint(self) -> str:
        """The parts' identity: a digest of their checksums."""
        return hashlib.blake2b(json.dumps(self.sha256).encode(), digest_size=12).hexdigest()

    def part_path(self, rank: int) -> str:
        return self.path_of(self.files[rank])

    def path_of(self, name: str) -> str:
        """A file of the shard directory (or store prefix) the manifest was read from."""
        return f"{self.directory.rstrip('/')}/{name}" if is_url(self.directory) else os.path.join(self.directory, name)

    def to_json(self) -> Dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("directory")
        data["total"] = self.total
        return data


def part_name(index: int, parts: int) -> str:
    return f"part_{index:0{max(2, len(str(parts - 1)))}d}.jsonl"


DEEP_MANIFEST = "JSON nested too deeply"


def read_manifest(shard_dir: Optional[str], world_size: Optional[int] = None, resuming: bool = False) -> Manifest:
    """The manifest of `shard_dir`; with `world_size`, refuses a part count that differs from it (`resuming`: the run
    directory holds a checkpoint, which another shard, other training data to it, could not continue)."""
    if not shard_dir:
        raise DataError("data.shard_dir: data=presharded needs the directory written by `dsrecipes shard`")
    path: Any = f"{shard_dir.rstrip('/')}/{MANIFEST}" if is_url(shard_dir) else Path(shard_dir) / MANIFEST
    local = None if is_url(shard_dir) else Path(shard_dir)
    if local is not None and local.exists() and not local.is_dir():  # a file, a FIFO: never opened
        raise DataError(f"data.shard_dir: {shard_dir} is {not_regular(local) or 'a file'}, not a directory; give the directory "
                        "`dsrecipes shard ... --out DIR` wrote")
    if not (store_upload.exists(path) if local is None else path.is_file()):
        raise DataError(f"data.shard_dir: {path} not found; write the parts with `dsrecipes shard ... --out {shard_dir}`")
    try:
        data = (loads_bounded(store_upload.read_text(path), DEEP_MANIFEST) if local is None else
                read_json_file(path, DEEP_MANIFEST))  # bounded: the directory may be anyone's
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON; too large, a FIFO, nested too deeply
        raise DataError(f"{path}: not a manifest written by `dsrecipes shard` ({_why(exc)}); re-shard") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: not a manifest written by `dsrecipes shard` (not a JSON object); re-shard")
    data.pop("total", None)
    if data.get("version") != MANIFEST_VERSION:
        raise DataError(f"{path}: manifest version {data.get('version')!r}, expected {MANIFEST_VERSION}; re-shard")
    problem = _shape_problem(data)
    if problem:
        raise DataError(f"{path}: not a manifest written by `dsrecipes shard` ({problem}); re-shard")
    manifest = Manifest(**data, directory=str(shard_dir))
    if manifest.files != [part_name(p, manifest.parts) for p in range(manifest.parts)] or \
            manifest.val_file not in (None, VAL_PART):  # names from someone else's file: never a path elsewhere
        raise DataError(f"{path}: lists files other than the parts `dsrecipes shard` writes ({part_name(0, 2)}, ..., "
                        f"{VAL_PART}); a manifest names only files of its own directory, so nothing was read. "
                        "Re-shard")
    if world_size is not None and manifest.parts != world_size:
        again = reshard_command(manifest, world_size)
        if resuming:
            raise DataError(
                f"data.shard_dir: {shard_dir} holds {manifest.parts} parts but the run has {world_size} ranks, and a "
                f"presharded run resumes only on as many ranks as its shard has parts (a new shard is other training "
                f"data to the checkpoint, which refuses it): resume on {manifest.parts} ranks (launcher.num_gpus, "
                f"launcher.num_nodes), or start a new run in another trainer.output_dir on a shard for {world_size}: "
                f"`{again}`")
        raise DataError(
            f"data.shard_dir: {shard_dir} holds {manifest.parts} parts but the run has {world_size} ranks; each rank "
            f"reads exactly its own part. Re-shard for this world size: `{again}` and set data.shard_dir=NEW_DIR"
        )
    return manifest


def _why(exc: Exception) -> str:
    if isinstance(exc, Unreadable):
        return str(exc)
    return (exc.strerror or str(exc)) if isinstance(exc, OSError) else f"not JSON: {exc}"


def _shape_problem(data: Dict[str, Any]) -> str:
    """What in a manifest's JSON is not what `shard` writes, as far as a run relies on it ('' when nothing)."""
    known = {f.name for f in dataclasses.fields(Manifest)} - {"directory"}
    unknown, missing = sorted(set(data) - known), sorted(k for k in ("parts", "balance", "files", "counts", "sha256")
                                                         if k not in data)
    if unknown or missing:
        return f"unknown keys {', '.join(unknown)}" if unknown else f"no {', '.join(missing)}"
    parts, counts = data["parts"], data["counts"]
    if type(parts) is not int or parts < 1:
        return f"parts: {parts!r} is not a whole number >= 1"
    if not isinstance(counts, list) or len(counts) != parts or any(type(c) is not int or c < 0 for c in counts):
        return f"counts: not {parts} whole numbers >= 0"
    no_reference = data.get("no_reference")
    if no_reference is not None and (type(no_reference) is not int or not 0 <= no_reference <= sum(counts)):
        return f"no_reference: {no_reference!r} is not a whole number of rows between 0 and the parts' count"
    return ""


def shard_files(data: Any) -> Optional[List[str]]:
    """The files a manifest (its JSON) says `shard` wrote, itself included, or None when it is not the manifest of a
    dsrecipes shard: one carrying SHARD_MARKER, or (written before the marker) exactly the keys an older `shard`
    wrote. Either way its part names must be the ones `shard` gives: only these names are ever replaced or removed."""
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION or data.get(SHARD_MARKER, 1) != 1:
        return None
    known = {f.name for f in dataclasses.fields(Manifest)} - {"directory", SHARD_MARKER} | {"total"}
    if SHARD_MARKER not in data and not set(data) <= known:
        return None
    parts = data.get("parts")
    if type(parts) is not int or parts < 1 or data.get("files") != [part_name(p, parts) for p in range(parts)]:
        return None
    if data.get("val_file") not in (None, VAL_PART):
        return None
    # the quarantine is written exactly when rows were skipped (`dataset.bad_rows=skip`)
    names = [MANIFEST, *data["files"]] + ([VAL_PART] if data.get("val_file") else [])
    return names + ([QUARANTINE] if data.get("bad_rows") else [])


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class PartChanged(DataError, Refused):
    """A part is not the one its manifest lists: every run on the shard stops there, a resume too, until the parts are
    rebuilt. Refused, so the failed run prints no 'resume ... with' line: that command fails the same way again (was).
    The message names the `dsrecipes shard` command that writes the same parts again (`rebuild_command`)."""


def reshard_command(manifest: Manifest, parts: int) -> str:
    """The `dsrecipes shard` command that writes the same rows, read the same way (its recorded `shard_args`: the
    overrides that chose and read them, e.g. dataset.pairs_as, dataset.split), into `parts` parts in NEW_DIR. A
    manifest written before they were recorded gets its input files, balance and hold-out, and `OVERRIDES...`."""
    if manifest.shard_args:
        args, skip = [], False
        for arg in manifest.shard_args:
            if skip:
                skip = False
                continue
            if arg == "--parts":
                skip = True
            elif not arg.startswith("--parts="):
                args.append(arg)
        return shlex.join(["dsrecipes", "shard", *args, "--parts", str(parts), "--out", "NEW_DIR"])
    sources = [s["path"] for s in manifest.sources] or ["INPUT..."]
    held = ["--val-size", str(manifest.val_count)] if manifest.val_count else []  # the same held-out rows
    return shlex.join(["dsrecipes", "shard", *sources, "--parts", str(parts), "--out", "NEW_DIR", "--balance",
                       manifest.balance, *held]) + " OVERRIDES..."


def rebuild_command(manifest: Manifest) -> str:
    """The `dsrecipes shard` command that writes this shard's parts again where they are read (--out, --force): the
    arguments it recorded (`shard_args`); a manifest written before they were recorded gets its input files and
    part count (what it was sharded with beyond them, e.g. dataset.max_samples, is not known: `OVERRIDES...`)."""
    out = manifest.directory if is_url(manifest.directory) else os.path.abspath(manifest.directory)
    held = ["--val-size", str(manifest.val_count)] if manifest.val_count else []
    args = manifest.shard_args or [*(s["path"] for s in manifest.sources), "--parts", str(manifest.parts),
                                   "--balance", manifest.balance, *held]
    command = shlex.join(["dsrecipes", "shard", *args, "--out", out, "--force"])
    return command if manifest.shard_args else f"{command} OVERRIDES..."


def _changed(path: str, what: str, manifest: Manifest) -> PartChanged:
    return PartChanged(f"{path}: {what}; a run reads only the parts `dsrecipes shard` wrote: write them again with "
                       f"`{rebuild_command(manifest)}`, then run the training command again (a run with a checkpoint "
                       "resumes from it)")


def verify_part(manifest: Manifest, rank: int) -> None:
    path = manifest.part_path(rank)
    if is_url(path):  # by the ETag recorded at upload: the part is not read twice
        if not manifest.identities or store_upload.identity_or_none(path) != manifest.identities[rank]:
            raise _changed(path, "missing or changed since `dsrecipes shard` wrote it", manifest)
        return
    _verify(path, manifest.sha256[rank], manifest)


def verify_val_part(manifest: Manifest) -> str:
    """The validation part's path, checked against the manifest (in a store: by the identity recorded at upload)."""
    path = manifest.path_of(str(manifest.val_file))
    if is_url(path):
        if manifest.val_identity is None or store_upload.identity_or_none(path) != manifest.val_identity:
            raise _changed(path, "missing or changed since `dsrecipes shard` wrote it", manifest)
        return path
    _verify(path, str(manifest.val_sha256), manifest)
    return path


def _verify(path: str, sha256: str, manifest: Manifest) -> None:
    what = not_regular(path)
    if what is not None:  # never opened: a FIFO's reader would wait for a writer
        raise _changed(path, f"is not a regular file ({what}), where {MANIFEST} lists a shard part", manifest)
    if not os.path.isfile(path):
        raise _changed(path, f"missing (listed in {MANIFEST})", manifest)
    if file_sha256(path) != sha256:
        raise _changed(path, f"sha256 differs from {MANIFEST}: the part was modified", manifest)


def check_identity(cfg: Any, tokenizer: Any) -> Dict[str, Any]:
    """What decides whether a row passes: the template config, the tokenizer itself and the row size limit."""

    template = choose_template(cfg.template, tokenizer, cfg.model.path)  # `auto` as the launch resolves it
    return {"template": config_to_dict(template), "tokenizer": tokenizer_fingerprint(tokenizer),
            "max_row_bytes": cfg.dataset.max_row_bytes, **token_limits(cfg)}


def token_limits(cfg: Any) -> Dict[str, int]:
    """The token limits past which a row of the run's kind is a bad row: a pair's prompt past `data.cutoff_len`
    (`cutoff_len`), a prompt past `data.cutoff_len - objective.max_completion_length`, the room its sampled
    completions get (`prompt_budget`); none for conversations, which are truncated."""
    fmt = row_format(cfg)
    if fmt == PAIR_ROW_FORMAT:
        return {"cutoff_len": cfg.data.cutoff_len}
    if fmt == PROMPT_ROW_FORMAT:
        return {"prompt_budget": cfg.data.cutoff_len - cfg.objective.max_completion_length}
    return {}


def checked_alike(checked_with: Dict[str, Any], cfg: Any, tokenizer: Any) -> bool:
    """Whether rows `dsrecipes shard` checked with `checked_with` pass this run's checks too: the same template and
    tokenizer, and limits no smaller (a manifest that recorded no such limit was not checked against it)."""
    now = check_identity(cfg, tokenizer)
    return (checked_with.get("template") == now["template"] and checked_with.get("tokenizer") == now["tokenizer"]
            and now["max_row_bytes"] >= checked_with.get("max_row_bytes", float("inf"))
            and all(now[key] >= checked_with.get(key, float("inf")) for key in token_limits(cfg)))
