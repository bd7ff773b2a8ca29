"""`dsrecipes shard [INPUT...] --parts N --out DIR [--balance samples|tokens] [--val-size N] [overrides]`: one JSONL part per rank.

Rows are read through the data layer (every format, column mapping, role alias and bad-row policy of `dataset`),
checked exactly as training checks them (read, normalised, rendered and tokenized with the run's template and
tokenizer: `scan.checked_conversations`, or `checked_pairs` under objective=dpo), and written in one canonical
form (shard_rows.py: conversations, or preference pairs, a pair being one sample), so a part needs no column settings
and the sample ids survive (`<source file>:<line>` when the row had none); the manifest's `row_format` says which. `manifest.json` records per-part counts (and token totals), sha256 checksums, the balance mode, the source
files with their checksums, the bad rows per reason and per file, and what the rows were checked with
(`checked_with`: template and tokenizer; a presharded run with another one scans its parts before launch).

Validation: `--val-size N` (a count, or a fraction < 1) holds N samples out of the parts into `val.jsonl` (chosen
like a run's validation split, seeded by `trainer.seed`), listed in the manifest with its count and checksum; a
presharded run evaluates on it.

Balance: every part gets the same number of samples (+-1), so equal step counts lose less than one global batch.
`samples` deals rows round-robin; `tokens` additionally evens out tokens (longest first, to the part with the
fewest tokens that still has room), using the run's tokenizer and template.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import dsrecipes.data.shard_store as store_upload
from dsrecipes.data.cache import tokenizer_fingerprint
from dsrecipes.data.render.template_choice import choose_template
from dsrecipes.data.shard_rows import PAIR_ROW_FORMAT, ROW_FORMAT, checked_rows, row_format
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.files import expand_paths
from dsrecipes.data.sources.preference import check_sources
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.remote import identity as remote_identity
from dsrecipes.data.sources.remote import is_url
from dsrecipes.data.sources.splits import split_val
from dsrecipes.errors import DataError, UserError
from dsrecipes.fileio import atomic_write_json
from dsrecipes.schema import ShardBalance
from dsrecipes.typed import config_to_dict

MANIFEST = "manifest.json"
VAL_PART = "val.jsonl"
MANIFEST_VERSION = 1


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
    version: int = MANIFEST_VERSION
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


def read_manifest(shard_dir: Optional[str], world_size: Optional[int] = None) -> Manifest:
    """The manifest of `shard_dir`; with `world_size`, refuses a part count that differs from it."""
    if not shard_dir:
        raise DataError("data.shard_dir: data=presharded needs the directory written by `dsrecipes shard`")
    path: Any = f"{shard_dir.rstrip('/')}/{MANIFEST}" if is_url(shard_dir) else Path(shard_dir) / MANIFEST
    if not (store_upload.exists(path) if is_url(shard_dir) else path.is_file()):
        raise DataError(f"data.shard_dir: {path} not found; write the parts with `dsrecipes shard ... --out {shard_dir}`")
    data = json.loads(store_upload.read_text(path) if is_url(shard_dir) else path.read_text(encoding="utf-8"))
    data.pop("total", None)
    if data.get("version") != MANIFEST_VERSION:
        raise DataError(f"{path}: manifest version {data.get('version')!r}, expected {MANIFEST_VERSION}; re-shard")
    manifest = Manifest(**data, directory=str(shard_dir))
    if world_size is not None and manifest.parts != world_size:
        sources = " ".join(s["path"] for s in manifest.sources) or "INPUT..."
        raise DataError(
            f"data.shard_dir: {shard_dir} holds {manifest.parts} parts but the run has {world_size} ranks; each rank "
            f"reads exactly its own part. Re-shard for this world size: `dsrecipes shard {sources} --parts "
            f"{world_size} --out NEW_DIR --balance {manifest.balance}` and set data.shard_dir=NEW_DIR"
        )
    return manifest


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_part(manifest: Manifest, rank: int) -> None:
    path = manifest.part_path(rank)
    if is_url(path):  # by the ETag recorded at upload: the part is not read twice
        if not manifest.identities or store_upload.identity_or_none(path) != manifest.identities[rank]:
            raise DataError(f"{path}: missing or changed since `dsrecipes shard` wrote it ({MANIFEST}); re-shard")
        return
    _verify(path, manifest.sha256[rank])


def verify_val_part(manifest: Manifest) -> str:
    """The validation part's path, checked against the manifest (in a store: by the identity recorded at upload)."""
    path = manifest.path_of(str(manifest.val_file))
    if is_url(path):
        if manifest.val_identity is None or store_upload.identity_or_none(path) != manifest.val_identity:
            raise DataError(f"{path}: missing or changed since `dsrecipes shard` wrote it ({MANIFEST}); re-shard")
        return path
    _verify(path, str(manifest.val_sha256))
    return path


def _verify(path: str, sha256: str) -> None:
    if not os.path.isfile(path):
        raise DataError(f"{path}: missing (listed in {MANIFEST})")
    if file_sha256(path) != sha256:
        raise DataError(f"{path}: sha256 differs from {MANIFEST}; the part was modified, re-shard")


# ---------------------------------------------------------------------------------------------------------------
# Rows


def assign_balanced(tokens: Sequence[int], parts: int) -> List[int]:
    """Part of each sample: counts equal (+-1), token totals as even as a greedy longest-first pass makes them."""
    total = len(tokens)
    floor, extra = divmod(total, parts)
    heap = [(0, p) for p in range(parts)]
    counts = [0] * parts
    out = [0] * total
    for i in sorted(range(total), key=lambda k: -tokens[k]):
        while True:
            load, p = heapq.heappop(heap)
            room = counts[p] < floor or (counts[p] == floor and extra > 0)
            if room:
                break
        out[i] = p
        counts[p] += 1
        if counts[p] == floor + 1:
            extra -= 1
        if counts[p] < floor or (counts[p] == floor and extra > 0):
            heapq.heappush(heap, (load + tokens[i], p))
    return out


def write_parts(lines: Iterator[bytes], assignment: Optional[Sequence[int]], parts: int, out_dir: Path,
                tokens: Optional[Sequence[int]] = None) -> Manifest:
    """Write canonical row lines into parts (round-robin without `assignment`; assignment -1: the validation part);
    returns the manifest (not yet written)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [part_name(p, parts) for p in range(parts)]
    with_val = assignment is not None and -1 in assignment
    handles = [open(out_dir / f, "wb") for f in files + ([VAL_PART] if with_val else [])]
    digests = [hashlib.sha256() for _ in handles]
    counts = [0] * len(handles)  # the validation part last
    part_tokens = [0] * parts
    try:
        for k, line in enumerate(lines):
            p = k % parts if assignment is None else assignment[k]
            handles[p].write(line)  # p = -1: the last handle, the validation part
            digests[p].update(line)
            counts[p] += 1
            if tokens is not None and p >= 0:
                part_tokens[p] += tokens[k]
    finally:
        for h in handles:
            h.close()
    sha = [d.hexdigest() for d in digests]
    manifest = Manifest(parts, "samples", files, counts[:parts], sha[:parts],
                        tokens=part_tokens if tokens is not None else None, directory=str(out_dir))
    if with_val:
        manifest.val_file, manifest.val_count, manifest.val_sha256 = VAL_PART, counts[-1], sha[-1]
    return manifest


def assign_parts(tokens: Sequence[int], parts: int, balance: ShardBalance, val_size: float, seed: int) -> List[int]:
    """Part of each sample (-1: the validation part): `val_size` samples held out by `splits.split_val` (seeded
    like a run's), the others dealt round-robin (`samples`) or balanced by tokens."""

    held = set(split_val(len(tokens), val_size, seed))
    rest = [i for i in range(len(tokens)) if i not in held]
    dealt = (assign_balanced([tokens[i] for i in rest], parts) if balance is ShardBalance.tokens
             else [k % parts for k in range(len(rest))])
    out = [-1] * len(tokens)
    for i, p in zip(rest, dealt):
        out[i] = p
    return out


def _shard_file(name: str) -> bool:
    """A name `shard` writes (or an earlier, interrupted shard left): a directory holding only these is ours."""
    return name in (MANIFEST, VAL_PART, "quarantine.jsonl") or bool(re.fullmatch(r"part_\d+\.jsonl", name))


def shard(cfg: Any, parts: int, out_dir: str, balance: ShardBalance = ShardBalance.samples,
          force: bool = False, val_size: float = 0) -> Manifest:
    """Split the samples of `cfg.dataset` into `parts` canonical JSONL files plus manifest.json in `out_dir`;
    `val_size` (a fraction < 1 or a count) holds samples out into the validation part `val.jsonl`."""
    from dsrecipes.data.stream.scan import checking_encoder  # lazy: else `commands.shard` imports numpy 0.11 s
    from dsrecipes.model import load_tokenizer  # lazy: else `commands.shard` imports torch 3.80 s

    if parts < 1:
        raise UserError(f"--parts must be >= 1, got {parts}")
    if val_size < 0 or (val_size >= 1 and val_size != int(val_size)):
        raise UserError(f"--val-size: a fraction in [0, 1) or a whole number of samples, got {val_size:g}")
    if is_url(out_dir):
        return store_upload.shard_to_store(cfg, parts, out_dir, balance, force, shard, val_size)
    out = Path(out_dir)
    if (out / MANIFEST).exists() and not force:
        raise UserError(f"{out / MANIFEST} exists; choose another --out or pass --force to overwrite")
    if out.is_dir() and any(not _shard_file(e.name) for e in out.iterdir()):  # a user's directory, not ours
        raise UserError(f"--out: {out} is not empty and holds no {MANIFEST}; shard writes into a new or empty "
                        "directory (or over an earlier shard directory with --force). Nothing was changed")
    notes: List[str] = []
    sources = resolve_sources(cfg.dataset, notes)
    for note in notes:
        print(note, file=sys.stderr)
    check_sources(cfg.objective.kind, sources)
    for src in sources:
        if src.weight != 1.0:
            raise UserError(f"source {src.name!r}: mixing weights are not applied by shard (weight {src.weight})")
    tokenizer = load_tokenizer(cfg)
    encoder = checking_encoder(cfg, tokenizer)
    tokens: Optional[List[int]] = None
    assignment: Optional[List[int]] = None
    if balance is ShardBalance.tokens or val_size > 0:  # a first pass: token counts, and how many samples there are
        first = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction)
        counted = [n for _, n in checked_rows(cfg, first, encoder, sources)]
        assignment = assign_parts(counted, parts, balance, val_size, cfg.trainer.seed)
        tokens = counted if balance is ShardBalance.tokens else None
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, out / "quarantine.jsonl")
    manifest = write_parts((line for line, _ in checked_rows(cfg, report, encoder, sources)), assignment, parts,
                           out, tokens)
    manifest.balance = balance.value
    manifest.row_format = row_format(cfg)
    manifest.bad_rows = dict(report.counts)
    manifest.bad_rows_by_file = report.files()
    manifest.checked_with = check_identity(cfg, tokenizer)
    for src in sources:
        files, _ = expand_paths(src.paths)
        manifest.sources += [{"path": f, "identity": remote_identity(f), "source": src.name} if is_url(f) else
                             {"path": os.path.abspath(f), "sha256": file_sha256(f), "source": src.name} for f in files]
    if min(manifest.counts) == 0:
        raise DataError(f"{manifest.total} samples cannot fill {parts} parts (a part would be empty)")
    atomic_write_json(out / MANIFEST, manifest.to_json())
    return manifest


def check_identity(cfg: Any, tokenizer: Any) -> Dict[str, Any]:
    """What decides whether a row passes: the template config, the tokenizer itself and the row size limit."""

    template = choose_template(cfg.template, tokenizer, cfg.model.path)  # `auto` as the launch resolves it
    out = {"template": config_to_dict(template), "tokenizer": tokenizer_fingerprint(tokenizer),
           "max_row_bytes": cfg.dataset.max_row_bytes}
    if row_format(cfg) == PAIR_ROW_FORMAT:  # a pair's prompt past the cutoff is a bad row
        out["cutoff_len"] = cfg.data.cutoff_len
    return out


def checked_alike(checked_with: Dict[str, Any], cfg: Any, tokenizer: Any) -> bool:
    """Whether rows `dsrecipes shard` checked with `checked_with` pass this run's checks too."""
    now = check_identity(cfg, tokenizer)
    return (checked_with.get("template") == now["template"] and checked_with.get("tokenizer") == now["tokenizer"]
            and now["max_row_bytes"] >= checked_with.get("max_row_bytes", float("inf"))
            and now.get("cutoff_len", 0) >= checked_with.get("cutoff_len", 0))
