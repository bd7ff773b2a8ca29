"""Index and check a stream before any rank starts (data=iterable), and the row checks of training for other readers.

`prepare_stream` is the launching process's part of `data=iterable`: it indexes the files (stream/index.py: blocks,
caps, held-out validation rows; JSON arrays and gzip converted once), scans them when `data.prescan` is on,
writes the index into the run directory and returns the samples of one epoch, which the run plan records
(`RunPlan.rows`) and every rank checks.

The scan reads every row once (training and validation rows) with exactly the checks the loaders apply: parsing and
normalising (`sharegpt.parse_item`), then rendering and tokenizing (`tokenize.Encoder`, in batches). The
ranks stream the same rows later under the same bad-row policy, but a worker that meets a bad row deep in the stream
can neither stop the others cleanly nor write the quarantine. So `bad_rows=error` stops at the first bad row with
`file:line: reason` before any process group exists, `bad_rows=skip` writes `<run>/quarantine.jsonl` and enforces
`dataset.max_bad_fraction`, and a row the scan passed cannot fail mid-run. Opt out with `data.prescan=false` for
streams too large to read twice (indexing still reads every byte once, cached by content); what the run then does not
get (the quarantine, the stream's first bad row, GRPO's reference count) is said at launch (stream/unscanned.py).

`checked_conversations` applies the same checks to sources read through `files.py` (`dsrecipes shard`, and
`scan_sources` for presharded parts checked with another template or tokenizer).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from dsrecipes.core.choices import RowKind
from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.core.tokenizer import load_tokenizer
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.prepare.build import QUARANTINE_FILE
from dsrecipes.data.prepare.cache import (
    PREP_VERSION,
    as_before,
    cache_root,
    data_files,
    data_fingerprint,
    tokenizer_fingerprint,
)
from dsrecipes.data.prepare.prompts import say_references
from dsrecipes.data.rowkinds import ROW_KINDS, resolved
from dsrecipes.data.sources.badrows import BadReason, BadRow, BadRowReport
from dsrecipes.data.sources.files import element_line
from dsrecipes.data.sources.preference import check_sources
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.sharegpt import Conversation, conversation_dict, iter_conversations
from dsrecipes.data.stream.index import (
    BlockSource,
    StreamIndex,
    file_sources,
    hold_out,
    index_stream,
    write_stream_index,
)
from dsrecipes.data.stream.scan_files import RowTap, Taps, load_scan, save_scan, scan_path
from dsrecipes.data.stream.shares import outside_of
from dsrecipes.data.stream.unscanned import unscanned_note

BATCH = 256  # conversations per tokenization call


def prepare_stream(cfg: TrainConfig, run_dir: Path) -> Tuple[int, str, int]:
    """(samples per epoch, data fingerprint, validation rows) of a stream; writes `<run>/stream_index.*` (and the
    quarantine). The row pre-scan runs in the pass that indexes the files (stream/scan_files.py): one read of the corpus,
    cold; none, warm."""
    rows, fingerprint, val, _ = prepare_stream_files(cfg, run_dir)
    return rows, fingerprint, val


def prepare_stream_files(cfg: TrainConfig, run_dir: Path) -> Tuple[int, str, int, Dict[str, str]]:
    """`prepare_stream` and {training file: content hash} (cache.data_files), both from the indexing pass's hashes:
    a fresh run's data identity costs no read of its own."""

    started = time.perf_counter()
    notes: List[str] = []
    sources = resolve_sources(cfg.dataset, notes)
    check_sources(cfg.objective.rows, sources)
    for note in notes + [n for n in [unscanned_note(cfg)] if n]:
        print(note, file=sys.stderr)
    scanning = _Scanning(cfg, run_dir) if cfg.data.prescan else None
    index = index_stream(cfg, scanning.taps.factory if scanning else None)
    bad_train: List[int] = []
    if scanning is not None:
        scan_stream(cfg, run_dir, index, scanning, bad_train)
    for fi in index.files if scanning is None else ():  # what the index knows without a scan: said, not quarantined
        if fi.problem is not None:
            print(f"data: {fi.name}: {fi.problem[0]} ({fi.problem[1]}): skipped (dataset.bad_rows=skip)", file=sys.stderr)
    hold_out(index, cfg)  # after the scan: a bad row is reported as such, not as too little data
    write_stream_index(run_dir, index)
    total = index.table().epoch_length()
    rows = total if cfg.data.num_samples is None else cfg.data.num_samples
    if rows > total:
        raise DataError(f"data.num_samples={rows} but the stream has {total} training samples per epoch; "
                        f"set data.num_samples={total} or leave it unset")
    blocks, per_chunk = int(index.blocks["count"].size), index.blocks_per_chunk
    chunks = f" (ordered in chunks of {per_chunk})" if per_chunk > 1 else ""
    others = f" ({index.outside.size} of other shares left out: dataset.split)" if index.outside.size else ""
    print(f"data: stream indexed: {len(index.files)} files, {index.num_lines} lines{others} in {blocks} blocks of "
          f"~{index.block_bytes} bytes{chunks}, {index.num_val} validation rows, "
          f"{trained_per_epoch(index, rows, bad_train, cfg.data.num_samples is None)} "
          f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    digests = {fi.name: fi.digest for fi in index.files}  # hashed once, in the indexing pass
    return rows, data_fingerprint(cfg, sources, digests), index.num_val, data_files(cfg, sources, digests)


def trained_per_epoch(index: StreamIndex, rows: int, bad_train: List[int], whole: bool) -> str:
    """`N training samples per epoch`: what an epoch trains. Bad rows the scan skipped (`dataset.bad_rows=skip`)
    keep their slot in the order but are dropped when read, so a whole epoch of unweighted sources trains `rows`
    minus the bad rows outside the validation hold-out; otherwise their count is said beside the slots."""
    held = set(index.holdout.tolist())
    skipped = sum(1 for n in bad_train if n not in held)
    if not skipped:
        return f"{rows} training samples per epoch"
    if whole and all(w == 1.0 for _, w in index.sources):
        return f"{rows - skipped} training samples per epoch ({rows} lines, {skipped} bad rows skipped)"
    return f"{rows} training slots per epoch ({skipped} bad training rows among the lines are skipped when read)"


class _Scanning:
    """The pre-scan's state across the indexing pass: report, encoder, the taps and the scan cache key."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        self.cfg = cfg
        self.report, self.encoder = _start(cfg, run_dir)
        self.root = cache_root(cfg) / "stream"
        self.key = _scan_key(cfg, self.encoder)
        self.taps = Taps(self._tap)

    def _tap(self, name: str, src: SourceConfig) -> Any:
        checker = _checker(self.cfg)(name, src, False, self.cfg.dataset.max_row_bytes, self.encoder)
        return RowTap(checker, self.cfg.dataset.max_row_bytes)


def checking_encoder(cfg: TrainConfig, tokenizer: Any) -> Any:
    """What renders and tokenizes a row of the run's kind (`objective.rows`) for the checks of training."""
    return ROW_KINDS[cfg.objective.rows].encoding(tokenizer, cfg)


def _checker(cfg: TrainConfig) -> Any:
    return ROW_KINDS[cfg.objective.rows].checker_factory()


def _scan_key(cfg: TrainConfig, encoder: Any) -> str:
    """What a file's scan result depends on besides its content: row reading and normalising, template,
    tokenization (the bad-row policy and caps are applied afterwards)."""

    dataset = {k: v for k, v in as_before("dataset", cfg.dataset).items() if k not in ("bad_rows", "max_bad_fraction")}
    material = {"version": PREP_VERSION, "dataset": dataset, "template": config_to_dict(cfg.template),
                "data": {k: config_to_dict(getattr(cfg.data, k)) for k in ("cutoff_len", "packing", "train_on")},
                "tokenizer": tokenizer_fingerprint(encoder.tokenizer)}
    spec = ROW_KINDS[cfg.objective.rows]
    if spec.keyed:  # another check per row; SFT keys stay as they were
        material["rows"] = cfg.objective.rows.value
    material.update(spec.check_settings(cfg))  # e.g. a prompt's budget: cutoff_len - max_completion_length
    return hashlib.blake2b(json.dumps(material, sort_keys=True, default=str).encode(), digest_size=10).hexdigest()


def scan_stream(cfg: TrainConfig, run_dir: Path, index: Optional[StreamIndex] = None,
                scanning: Optional[_Scanning] = None, bad_train: Optional[List[int]] = None) -> Dict[str, int]:
    """Every row checked once under the bad-row policy (from the indexing pass, the scan cache, or read by
    blocks); returns {'rows': read, 'good': kept, 'skipped': bad}. `bad_train` gets the natural numbers (as
    hold_out counts them) of the bad training rows."""

    scanning = _Scanning(cfg, run_dir) if scanning is None else scanning
    index = index_stream(cfg) if index is None else index
    report, good, no_reference = scanning.report, 0, 0
    bases = dict(zip(index.train_files, itertools.accumulate([0] + [index.caps[f] for f in index.train_files])))
    bad_train = [] if bad_train is None else bad_train
    for f, (fi, src) in enumerate(zip(index.files, file_sources(cfg, index))):
        if fi.problem is not None:
            report.rows_read += 1
            report.add(fi.name, None, BadRow(BadReason(fi.problem[0]), fi.problem[1]))
            continue
        path = scan_path(scanning.root, fi.digest, scanning.key)
        result = load_scan(path)  # the digest is the original file's: a converted copy's scan is kept too
        if result is None:
            result = scanning.taps.result(fi.name, fi.size) if fi.path == fi.name else None
            result = result if result is not None else _read_scan(cfg, index, f, src, scanning.encoder)
            save_scan(path, result)
        other = outside_of(index, bases[f], index.caps[f]) if f in bases else frozenset()  # dataset.split
        good += _apply(report, fi.name, result, index.caps[f], other)
        no_reference += _without_reference(result, index.caps[f], other)
        if f in bases:
            bad_train += [bases[f] + b[0] for b in result.bad_rows() if b[0] < index.caps[f] and b[0] not in other]
    counts = _finish(report, good, run_dir)
    if cfg.objective.rows is RowKind.prompt:  # comparing rewards without references: said, or refused (DataError)
        say_references(cfg, good, no_reference)
    return counts


def _without_reference(scan: Any, cap: int, other: Any) -> int:
    """Good prompt rows of one file's scan (under its cap, outside other shares) that have no reference answer."""
    bad = {b[0] for b in scan.bad}
    return sum(1 for s in scan.no_reference or () if s < cap and s not in other and s not in bad)


def _read_scan(cfg: TrainConfig, index: StreamIndex, f: int, src: SourceConfig, encoder: Any) -> Any:
    """The scan of file f read by blocks (its index came from the cache, or it is a converted copy)."""

    fi = index.files[f]
    checker = _checker(cfg)(fi.name, src, fi.loc_base < 0, cfg.dataset.max_row_bytes, encoder)
    source = BlockSource(index, cfg.dataset.max_row_bytes)
    for local in range(fi.offsets.size):
        end = int(fi.firsts[local + 1]) if local + 1 < fi.offsets.size else fi.count
        for loc, raw in source.samples(f, local, end - int(fi.firsts[local])):
            checker.row(loc, raw)
    source.close()
    return checker.finish()


def _apply(report: BadRowReport, name: str, scan: Any, cap: int, other: Any = frozenset()) -> int:
    """The scan of one file under its cap and the bad-row policy, without the lines of `other` shares (their runs
    report them): the good rows it adds."""
    bad = [b for b in scan.bad_rows() if b[0] < cap and b[0] not in other]
    report.rows_read += cap - len(other)
    report.trailing_turns_dropped += sum(1 for s in scan.dropped if s < cap and s not in other)
    for _, line, row, raw, element in bad:
        report.add(name, line, row, raw, element)
    return cap - len(other) - len(bad)


def scan_sources(cfg: TrainConfig, run_dir: Path, sources: Sequence[SourceConfig]) -> Dict[str, int]:
    """The scan over files read through `files.py` (presharded parts); same checks, same counts and quarantine."""
    report, encoder = _start(cfg, run_dir)
    rows = resolved(ROW_KINDS[cfg.objective.rows].checked)
    good = sum(1 for _ in rows(cfg, report, encoder, list(sources)))
    return _finish(report, good, run_dir)


def checked_conversations(cfg: TrainConfig, report: BadRowReport, encoder: Any,
                          sources: Optional[List[SourceConfig]] = None) -> Iterator[Tuple[Conversation, Any]]:
    """(conversation, Example or None when nothing trained is left) of every row that passes the checks of
    training; bad rows (reading, normalising, rendering, tokenizing) go to `report`."""
    batch: List[Conversation] = []
    for conv in iter_conversations(cfg.dataset, report=report, sources=sources):
        batch.append(conv)
        if len(batch) == BATCH:
            yield from _encoded(batch, report, encoder)
            batch = []
    yield from _encoded(batch, report, encoder)


def _start(cfg: TrainConfig, run_dir: Path) -> Tuple[BadRowReport, Any]:

    quarantine = Path(run_dir) / QUARANTINE_FILE
    quarantine.unlink(missing_ok=True)
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, quarantine_path=quarantine)
    return report, checking_encoder(cfg, load_tokenizer(cfg))


def _finish(report: BadRowReport, good: int, run_dir: Path) -> Dict[str, int]:
    report.check()
    counts = {"rows": report.rows_read, "good": good, "skipped": report.skipped}
    print(f"data: stream scanned: {report.rows_read} rows, {good} good, bad: {report.summary()}"
          + (f" (quarantined in {Path(run_dir) / QUARANTINE_FILE})" if report.skipped else ""), file=sys.stderr)
    return counts


def _encoded(convs: List[Conversation], report: BadRowReport, encoder: Any) -> Iterator[Tuple[Conversation, Any]]:
    if not convs:
        return
    errors: List[Any] = []
    examples = encoder.encode_batch(convs, errors)
    bad = {id(conv): b for conv, b in errors}
    for conv, example in zip(convs, examples):
        if id(conv) in bad:
            line = conv.loc if conv.element is None or conv.loc is not None else element_line(conv.path, conv.element)
            report.add(conv.path, line, bad[id(conv)], conversation_dict(conv), conv.element)
        else:
            yield conv, example


def _raw_text(raw: Optional[bytes]) -> Optional[str]:
    return None if raw is None else raw.decode("utf-8", errors="replace").rstrip("\r\n")

