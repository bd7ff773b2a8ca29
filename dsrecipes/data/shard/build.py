"""`dsrecipes shard [INPUT...] --parts N --out DIR [--balance samples|tokens] [--val-size N] [overrides]`: one JSONL part per rank.

Rows are read through the data layer (every format, column mapping, role alias and bad-row policy of `dataset`),
checked exactly as training checks them (read, normalised, rendered and tokenized with the run's template and
tokenizer: `scan.checked_conversations`, or `checked_pairs` for an objective on pairs, `objective.rows=pair`), and
written in one canonical form (shard_rows.py: conversations, or preference pairs, a pair being one sample), so a part
needs no column settings and the sample ids survive (`<source file>:<line>` when the row had none); the manifest's
`row_format` says which. `manifest.json` (shard_manifest.py: the record, reading and verifying it) records per-part
counts (and token totals), sha256 checksums, the balance mode, the source files with their checksums, the bad rows per
reason and per file, and what the rows were checked with (`checked_with`: template and tokenizer; a presharded run
with another one scans its parts before launch).

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
a staging directory beside `--out` (same file system), synced, then published with core/publish.py: renamed onto a
new or empty `--out`, or exchanged with the previous shard in one step (`Existing.exchange`), whose listed files are
removed only then: a reader sees the old complete shard or the new one, never a mix, and a failure (a bad row, a full
disk) leaves `--out` as it was.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import heapq
import itertools
import os
import resource
import shutil
import sys
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import dsrecipes.data.shard.store as store_upload
from dsrecipes.core.errors import DataError, UserError
from dsrecipes.core.fileio import (
    atomic_write_json,
    dangling_link_problem,
    missing_dirs,
    read_json_file,
    remove_empty_dirs,
)
from dsrecipes.core.publish import Existing, publish_dir, staging_dir
from dsrecipes.core.schema import RowKind, ShardBalance
from dsrecipes.core.tokenizer import load_tokenizer
from dsrecipes.data.prepare.cache import cache_root
from dsrecipes.data.shard.manifest import (
    MANIFEST,
    QUARANTINE,
    VAL_PART,
    Manifest,
    check_identity,
    file_sha256,
    part_name,
)
from dsrecipes.data.shard.manifest import SHARD_MARKER as SHARD_MARKER  # re-exported: the manifest's names, as before
from dsrecipes.data.shard.manifest import checked_alike as checked_alike
from dsrecipes.data.shard.manifest import read_manifest as read_manifest
from dsrecipes.data.shard.manifest import shard_files as shard_files
from dsrecipes.data.shard.manifest import verify_part as verify_part
from dsrecipes.data.shard.manifest import verify_val_part as verify_val_part
from dsrecipes.data.shard.rows import checked_rows, row_format
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.files import expand_paths
from dsrecipes.data.sources.preference import check_sources
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.remote import check_url, is_url, looks_like_url
from dsrecipes.data.sources.remote import identity as remote_identity
from dsrecipes.data.sources.splits import split_val

OPEN_FILES_HEADROOM = 128  # descriptors left to the rest of the process while every part is open


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
          force: bool = False, val_size: float = 0, shard_args: Sequence[str] = ()) -> Manifest:
    """Split the samples of `cfg.dataset` into `parts` canonical JSONL files plus manifest.json in `out_dir`;
    `val_size` (a fraction < 1 or a count) holds samples out into the validation part `val.jsonl`. The shard appears
    in `out_dir` only complete (module docstring: Ownership); on any failure `out_dir` is as it was. `shard_args`
    (the command's arguments but --out and --force) are recorded: a changed part is refused with them."""
    from dsrecipes.data.stream.scan import checking_encoder  # lazy: else `commands.shard` imports numpy 0.11 s

    _check_arguments(parts, val_size, out_dir)
    if is_url(out_dir):
        return store_upload.shard_to_store(cfg, parts, out_dir, balance, force,
                                           functools.partial(shard, shard_args=shard_args), shard_files, val_size)
    link = dangling_link_problem("--out", out_dir)  # realpath would name the missing target, and shard would make it
    if link:
        raise UserError(link)
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
        written, report = _written(cfg, encoder, sources, assignment, parts, staging, tokens)
        manifest = describe_parts(written, cfg, balance, report, check_identity(cfg, tokenizer), sources)
        manifest.shard_args = list(shard_args)
        atomic_write_json(staging / MANIFEST, manifest.to_json())
        sync_dir(staging, files=True)
        # onto a new or empty --out (one that gained entries meanwhile is refused), or exchanged with our previous shard
        old = publish_dir(staging, out, Existing.exchange if previous is not None else Existing.refuse)
    except BaseException as exc:
        discard(staging, made)
        if isinstance(exc, OSError):  # a full disk, too many open files, no permission, out changed meanwhile
            where = f" ({exc.filename})" if exc.filename else ""
            raise UserError(f"--out: writing the shard to {out} failed: {exc.strerror or exc}{where}; "
                            "nothing was changed") from None
        raise
    with contextlib.suppress(OSError):  # the rename itself is durable once the parent directory is synced
        sync_dir(out.parent)
    if old is not None and previous is not None:
        remove_listed(old, previous)  # now the previous shard, out of sight
    manifest.directory = out_dir
    return manifest


def _written(cfg: Any, encoder: Any, sources: List[Any], assignment: Optional[List[int]], parts: int, staging: Path,
             tokens: Optional[List[int]]) -> Tuple[Manifest, BadRowReport]:
    """The parts written into `staging` from the rows that pass training's checks, and the report of the bad ones.
    The quarantine is written in our cache while the rows are read and moved into the shard once the parts are
    written: a refused shard (too many bad rows) removes its staging directory, and its message names the file."""
    quarantine = _quarantine_path(cfg, staging)
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, quarantine)
    no_reference: List[int] = []  # prompt rows without a reference answer (the run's comparing rewards need it)
    lines = (line for line, _ in checked_rows(cfg, report, encoder, sources, no_reference))
    lines = lines if assignment is not None else filling(lines, parts)  # the part count checked before writing
    written = write_parts(lines, assignment, parts, staging, tokens)
    if quarantine != staging / QUARANTINE and quarantine.exists():
        shutil.move(str(quarantine), str(staging / QUARANTINE))
    if cfg.objective.rows is RowKind.prompt:  # counted in the training parts: the run says it or refuses
        written.no_reference = sum(1 for k in no_reference if assignment is None or assignment[k] >= 0)
    return written, report


def _quarantine_path(cfg: Any, staging: Path) -> Path:
    """Where the bad rows are quarantined while the rows are read: `<cache>/shard-quarantine/` (made with the first
    bad row, as the report writes it), else, where the cache cannot be written, the staging directory."""
    folder = cache_root(cfg) / "shard-quarantine"
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not os.access(existing, os.W_OK | os.X_OK):
        return staging / QUARANTINE
    return folder / f"{staging.name}-quarantine.jsonl"


def _check_arguments(parts: int, val_size: float, out_dir: str) -> None:
    if parts < 1:
        raise UserError(f"--parts must be >= 1, got {parts}")
    if val_size < 0 or (val_size >= 1 and val_size != int(val_size)):
        raise UserError(f"--val-size: a fraction in [0, 1) or a whole number of samples, got {val_size:g}")
    url_problem = check_url(out_dir) if looks_like_url(out_dir) else None  # credentials refused, never echoed
    if url_problem:
        raise UserError(f"--out: {url_problem}")


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
    """A staging directory beside `path` (core/publish.py `staging_dir`: same file system, so it can be published onto
    it), and the parent directories that had to be made for it (deepest first)."""
    made = missing_dirs(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return staging_dir(path, tag), made
    except OSError as exc:
        discard(None, made)
        raise UserError(f"--out: cannot create a directory beside {path} ({exc.strerror or exc}); "
                        "nothing was changed") from None


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
        # bounded: a FIFO named manifest.json is not ours (no wait); nor is one too large or nested too deeply
        return read_json_file(path, "JSON nested too deeply to be a shard manifest")
    except (OSError, ValueError):
        return None


def _shown(names: Sequence[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _cwd() -> Optional[str]:
    try:
        return os.getcwd()
    except OSError:  # the working directory was removed
        return None
