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

Ownership: `--out` is the user's until proven ours. A new directory, an empty one, or (with `--force`) a shard
directory holding our manifest (`dsrecipes_shard`, or the exact shape an older `shard` wrote) and nothing its
manifest does not list; anything else is refused before any row is read, nothing changed. What can be checked
before writing is checked first (the part count against the samples, the open-file limit). The shard is written into
a new directory beside `--out` (same file system), synced, then renamed into place, or exchanged with the previous
shard in one step (Linux `renameat2`), whose listed files are removed only then: a reader sees the old complete
shard or the new one, never a mix, and a failure (a bad row, a full disk) leaves `--out` as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import heapq
import itertools
import json
import os
import resource
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import dsrecipes.data.shard_store as store_upload
from dsrecipes.core.errors import DataError, UserError
from dsrecipes.core.fileio import atomic_write_json, missing_dirs, remove_empty_dirs
from dsrecipes.core.schema import ShardBalance
from dsrecipes.core.tokenizer import load_tokenizer
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.cache import tokenizer_fingerprint
from dsrecipes.data.render.template_choice import choose_template
from dsrecipes.data.shard_rows import PAIR_ROW_FORMAT, ROW_FORMAT, checked_rows, row_format
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.files import expand_paths
from dsrecipes.data.sources.preference import check_sources
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.remote import check_url, is_url, looks_like_url
from dsrecipes.data.sources.remote import identity as remote_identity
from dsrecipes.data.sources.splits import split_val

MANIFEST = "manifest.json"
VAL_PART = "val.jsonl"
QUARANTINE = "quarantine.jsonl"
MANIFEST_VERSION = 1
SHARD_MARKER = "dsrecipes_shard"  # the manifest key that says `dsrecipes shard` wrote it (older manifests lack it)
OPEN_FILES_HEADROOM = 128  # descriptors left to the rest of the process while every part is open


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
    returns the manifest (not yet written). Every part stays open while the rows stream through (`open_files`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [part_name(p, parts) for p in range(parts)]
    with_val = assignment is not None and -1 in assignment
    names = files + ([VAL_PART] if with_val else [])
    with open_files(len(names), parts), contextlib.ExitStack() as stack:
        handles = [stack.enter_context(open(out_dir / f, "wb")) for f in names]
        digests = [hashlib.sha256() for _ in handles]
        counts = [0] * len(handles)  # the validation part last
        part_tokens = [0] * parts
        for k, line in enumerate(lines):
            p = k % parts if assignment is None else assignment[k]
            handles[p].write(line)  # p = -1: the last handle, the validation part
            digests[p].update(line)
            counts[p] += 1
            if tokens is not None and p >= 0:
                part_tokens[p] += tokens[k]
    sha = [d.hexdigest() for d in digests]
    manifest = Manifest(parts, "samples", files, counts[:parts], sha[:parts],
                        tokens=part_tokens if tokens is not None else None, directory=str(out_dir))
    if with_val:
        manifest.val_file, manifest.val_count, manifest.val_sha256 = VAL_PART, counts[-1], sha[-1]
    return manifest


@contextlib.contextmanager
def open_files(needed: int, parts: int) -> Iterator[None]:
    """Room for `needed` more open files: the soft limit raised (up to the hard one) for the block. UserError, before
    anything is opened, when even the hard limit leaves no room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + OPEN_FILES_HEADROOM
    if hard != resource.RLIM_INFINITY and want > hard:
        raise UserError(f"--parts {parts}: writing the parts keeps {needed} files open, more than this process may "
                        f"open (ulimit -n: {hard}); raise the limit or shard into fewer parts. Nothing was changed")
    raised = soft != resource.RLIM_INFINITY and want > soft
    if raised:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        if raised:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def check_fill(samples: int, parts: int) -> None:
    """DataError when `samples` leave a part empty (checked before any part is written)."""
    if samples < parts:
        raise DataError(f"{samples} samples cannot fill {parts} parts (a part would be empty); shard into at most "
                        f"{samples} parts. Nothing was changed")


def filling(lines: Iterator[bytes], parts: int) -> Iterator[bytes]:
    """`lines` (dealt round-robin), once their first `parts` (held in memory) show that every part gets one."""
    head = list(itertools.islice(lines, parts))
    check_fill(len(head), parts)
    return itertools.chain(head, lines)


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


def shard(cfg: Any, parts: int, out_dir: str, balance: ShardBalance = ShardBalance.samples,
          force: bool = False, val_size: float = 0) -> Manifest:
    """Split the samples of `cfg.dataset` into `parts` canonical JSONL files plus manifest.json in `out_dir`;
    `val_size` (a fraction < 1 or a count) holds samples out into the validation part `val.jsonl`. The shard appears
    in `out_dir` only complete (module docstring: Ownership); on any failure `out_dir` is as it was."""
    from dsrecipes.data.stream.scan import checking_encoder  # lazy: else `commands.shard` imports numpy 0.11 s

    if parts < 1:
        raise UserError(f"--parts must be >= 1, got {parts}")
    if val_size < 0 or (val_size >= 1 and val_size != int(val_size)):
        raise UserError(f"--val-size: a fraction in [0, 1) or a whole number of samples, got {val_size:g}")
    url_problem = check_url(out_dir) if looks_like_url(out_dir) else None  # credentials refused, never echoed
    if url_problem:
        raise UserError(f"--out: {url_problem}")
    if is_url(out_dir):
        return store_upload.shard_to_store(cfg, parts, out_dir, balance, force, shard, shard_files, val_size)
    out = Path(os.path.realpath(out_dir))  # a link to a directory: the shard replaces the directory, not the link
    previous = claim_out(out, force)
    notes: List[str] = []
    sources = resolve_sources(cfg.dataset, notes)
    for note in notes:
        print(note, file=sys.stderr)
    check_sources(cfg.objective.rows, sources)
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
        check_fill(sum(p >= 0 for p in assignment), parts)
    staging, made = new_dir_beside(out, "shard-tmp")
    try:
        report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, staging / QUARANTINE)
        lines = (line for line, _ in checked_rows(cfg, report, encoder, sources))
        lines = lines if assignment is not None else filling(lines, parts)  # the part count checked before writing
        written = write_parts(lines, assignment, parts, staging, tokens)
        manifest = describe_parts(written, cfg, balance, report, check_identity(cfg, tokenizer), sources)
        atomic_write_json(staging / MANIFEST, manifest.to_json())
        sync_dir(staging, files=True)
        publish(staging, out, previous is not None)
    except BaseException as exc:
        discard(staging, made)
        if isinstance(exc, OSError):  # a full disk, too many open files, no permission, out changed meanwhile
            where = f" ({exc.filename})" if exc.filename else ""
            raise UserError(f"--out: writing the shard to {out} failed: {exc.strerror or exc}{where}; "
                            "nothing was changed") from None
        raise
    with contextlib.suppress(OSError):  # the rename itself is durable once the parent directory is synced
        sync_dir(out.parent)
    if previous is not None:
        remove_listed(staging, previous)  # now the previous shard, out of sight
    manifest.directory = out_dir
    return manifest


def claim_out(out: Path, force: bool) -> Optional[List[str]]:
    """Check that `shard` may make `out` its shard directory, changing nothing: a new directory (below directories),
    an empty one, or with `force` a shard directory of ours that holds only what its manifest lists. Returns those
    files (None: no shard there); anything else is a UserError."""
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"--out: {out} lies below {parent}, which is a file; choose a directory")
            break
    if not out.exists():
        return None
    if not out.is_dir():
        raise UserError(f"--out: {out} is a file, not a directory; choose a directory for the parts")
    entries = sorted(os.listdir(out))
    listed = shard_files(_json_or_none(out / MANIFEST)) if MANIFEST in entries else None
    if entries and listed is None:
        raise UserError(f"--out: {out} is not empty ({_shown(entries)}) and holds no {MANIFEST} written by "
                        "`dsrecipes shard`; shard writes into a new or empty directory (or over an earlier shard "
                        "directory with --force). Choose another directory; nothing was changed")
    if listed is not None and not force:
        raise UserError(f"{out / MANIFEST} exists; choose another --out or pass --force to overwrite")
    unlisted = [e for e in entries if e not in (listed or [])]
    if unlisted:
        raise UserError(f"--out: {out} holds {_shown(unlisted)}, which its {MANIFEST} does not list; --force "
                        "replaces only a shard's own files. Move them elsewhere or choose another directory; nothing "
                        "was changed")
    cwd = _cwd()
    if os.path.ismount(out) or (cwd is not None and os.path.samefile(out, cwd)):
        what = "a mount point" if os.path.ismount(out) else "the current directory"
        raise UserError(f"--out: {out} is {what}; shard replaces its --out directory as a whole (by renaming), which "
                        "cannot be done to it. Choose a directory inside it; nothing was changed")
    return listed


def describe_parts(manifest: Manifest, cfg: Any, balance: ShardBalance, report: BadRowReport,
                   checked_with: Any, sources: List[Any]) -> Manifest:
    """`manifest` (the parts written) with how they were made: balance, row format, bad rows, the check's identity
    and every input file's identity (an object's ETag, a local file's sha256)."""
    manifest.balance = balance.value
    manifest.row_format = row_format(cfg)
    manifest.bad_rows = dict(report.counts)
    manifest.bad_rows_by_file = report.files()
    manifest.checked_with = checked_with
    for src in sources:
        files, _ = expand_paths(src.paths)
        manifest.sources += [{"path": f, "identity": remote_identity(f), "source": src.name} if is_url(f) else
                             {"path": os.path.abspath(f), "sha256": file_sha256(f), "source": src.name}
                             for f in files]
    return manifest


def new_dir_beside(path: Path, tag: str) -> Tuple[Path, List[Path]]:
    """A new, uniquely named hidden directory beside `path` (same file system, so it can be renamed onto it), and
    the parent directories that had to be made for it (deepest first)."""
    made = missing_dirs(path.parent)
    new = path.parent / f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        new.mkdir(parents=True)
    except OSError as exc:
        discard(None, made)
        raise UserError(f"--out: cannot create a directory beside {path} ({exc.strerror or exc}); "
                        "nothing was changed") from None
    return new, made


def publish(staging: Path, out: Path, replace: bool) -> None:
    """Make the complete shard in `staging` the directory `out`: renamed onto it (new, or empty: a directory that
    gained entries meanwhile fails with ENOTEMPTY), or with `replace` exchanged with the shard there, which is then
    in `staging`."""
    if replace:
        _exchange(staging, out)
    else:
        os.rename(staging, out)


def _exchange(new: Path, old: Path) -> None:
    """Swap two directories in one step (Linux renameat2 RENAME_EXCHANGE: `old` never goes missing). Where that is
    not available: `old` renamed aside, `new` into its place (`old` put back if that fails), the aside to `new`."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        at_fdcwd, rename_exchange = -100, 2
        if renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(old), rename_exchange) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: a file system without exchange
            raise OSError(code, os.strerror(code), str(old))
    aside, _ = new_dir_beside(old, "old-tmp")
    os.rename(old, aside)
    try:
        os.rename(new, old)
    except OSError:
        os.rename(aside, old)
        raise
    os.rename(aside, new)


def remove_listed(old: Path, names: Sequence[str]) -> None:
    """Remove a replaced shard: the files its manifest listed, then its directory (left, with a note, when it holds
    anything else)."""
    try:
        for name in names:
            (old / name).unlink(missing_ok=True)
        old.rmdir()
    except OSError as exc:
        print(f"note: the previous shard's files were kept in {old} ({exc.strerror or exc}); remove it when done",
              file=sys.stderr)


def discard(staging: Optional[Path], made: Sequence[Path]) -> None:
    """Take back a shard that was not published: its staging directory (created by this process) and the parent
    directories made for it while they are empty."""
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    remove_empty_dirs(made)


def sync_dir(path: Path, files: bool = False) -> None:
    """fsync a directory (its entries), with `files` also every file in it first."""
    names = sorted(os.listdir(path)) if files else []
    for name in [*names, "."]:
        fd = os.open(path / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _json_or_none(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _shown(names: Sequence[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _cwd() -> Optional[str]:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed
        return None


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
