"""Read, check and tokenize every conversation of a preparation, in `data.preprocess_workers` processes.

The launching process only reads bytes, through the bounded readers of files.py (`read_row_items`: a row longer
than `dataset.max_row_bytes` is never held, JSON arrays are cut into elements by jsonscan): it cuts each source's
files into chunks of at most CHUNK rows and CHUNK_BYTES bytes, unparsed, and hands them to the workers in order, a
few chunks ahead, so memory stays bounded whatever the size of the data. A worker parses and checks its rows
(`files.row_of`, `sharegpt.conversation_of`: every check any reader applies), renders and tokenizes the good ones
(tokenize.py; template and tokenizer refusals are bad rows) and returns flat arrays. The launching process takes
the chunks back in order and applies, row by row and exactly as a sequential read would, the bad-row policy (the
first bad row in file order stops an `error` run; template and tokenizer refusals are bad rows too, in their place;
a file that breaks before its end raises FileUnreadable in its place, after the rows before it) and the caps
(`sources[i].max_samples`, `dataset.max_samples`: rows after the cap are neither counted nor reported, and reading
stops).

The result is flat: one int32 array of all token ids and one of labels, with per-conversation starts and lengths,
so splitting, mixing and packing only index arrays (prepare.py, arrow_split.py).
"""

from __future__ import annotations

import gc
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.core.schema import DatasetConfig, SourceConfig, TrainConfig
from dsrecipes.data.render.prep_pool import PreparationPool
from dsrecipes.data.render.tokenize import Encoder
from dsrecipes.data.sources.badrows import BadReason, BadRow, BadRowReport
from dsrecipes.data.sources.files import (
    FileUnreadable,
    RawRow,
    expand_paths,
    no_file,
    read_row_items,
    row_of,
    used_columns,
)
from dsrecipes.data.sources.sharegpt import conversation_dict, conversation_of, role_table
from dsrecipes.data.sources.split_shares import keeps

CHUNK = 512  # rows per task
CHUNK_BYTES = 8 << 20  # bytes of rows per task (a row may be up to dataset.max_row_bytes)
AHEAD = 3  # tasks in flight per worker
GOOD, DROPPED, BAD, REFUSED, OTHER = 0, 1, 2, 3, 4  # row outcomes; REFUSED: the template refused the conversation;
# OTHER: a row of another share of dataset.split (not this run's row: neither read nor bad)


@dataclass
class Encoded:
    """All conversations (rows that normalised) tokenized: conversation i's tokens are
    input_ids[starts[i]:starts[i]+lengths[i]] (length 0: nothing trained left, or refused by the template)."""

    input_ids: np.ndarray
    labels: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    kept: np.ndarray  # indices of conversations with tokens
    dropped: List[int]  # nothing trained left after truncation
    ids: List[str]  # sample id of each conversation
    sources: List[str]  # source name of each conversation
    one_text: bool = True  # the template takes the one-text path (data/render/spans.py)
    per_segment: int = 0  # conversations tokenized per segment instead (a border check failed)
    history_cut: int = 0  # conversations that kept their last reply by dropping earlier turns (history_cut.py)


@dataclass
class _Chunk:
    """One task's rows, as a worker returns them."""

    status: np.ndarray  # int8 per row: GOOD, DROPPED, BAD, REFUSED
    ids: List[Optional[str]]  # sample id per row (None: BAD)
    trailing: np.ndarray  # bool per row: trailing non-assistant turns were dropped
    lengths: np.ndarray  # int64 per row (0 unless GOOD)
    truncated: np.ndarray  # bool per row
    input_ids: np.ndarray  # the GOOD rows' tokens, in row order
    labels: np.ndarray
    # (row, line, element, BadRow, raw), in row order (BadRow pickles with its reason, detail and advice)
    bad: List[Tuple[int, Optional[int], Optional[int], BadRow, Any]]
    one_text: bool = True
    per_segment: int = 0
    history_cut: Optional[np.ndarray] = None  # bool per row: kept its last reply by dropping earlier turns


@dataclass
class _Task:
    source: int
    path: str
    items: List[Any] = field(default_factory=list)  # files.RowItem or RawRow; empty with `missing` / `broken`
    missing: bool = False  # `path` is a pattern that matches no file
    broken: Optional[FileUnreadable] = None  # the file broke here: raised when this task's turn comes
    size: int = 0  # bytes of the items

    @property
    def local(self) -> bool:
        """Nothing for a worker to do."""
        return self.missing or self.broken is not None


# ----------------------------------------------------------------------------------------------------------------
# Workers


class _Worker:
    encoder: Optional[Encoder] = None
    limit: int = 0  # dataset.max_row_bytes
    sources: Sequence[SourceConfig] = ()
    tables: List[Any] = []
    failed: Optional[BaseException] = None  # what building the encoder raised; the first chunk raises it


def _init_worker(tokenizer: Any, cfg: TrainConfig, sources: Sequence[SourceConfig], parallel: bool) -> None:
    if parallel:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    try:
        _Worker.encoder = Encoder(tokenizer, cfg)  # renders probes: a hostile chat_template is refused here
    except Exception as exc:  # noqa: BLE001 - raised by the first chunk: one message (an initializer's breaks the pool)
        if not parallel:
            raise
        _Worker.failed = exc
    _Worker.limit = cfg.dataset.max_row_bytes
    _Worker.sources = sources
    _Worker.tables = [role_table(s) for s in sources]


def _encode_chunk(task: _Task) -> _Chunk:
    # The rows make no reference cycles; the collector's passes over them cost ~13% of a chunk's time.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _encode_rows(task)
    finally:
        if enabled:
            gc.enable()


def _encode_rows(task: _Task) -> _Chunk:
    if _Worker.failed is not None:  # back in the launching process through the task's result
        raise _Worker.failed
    source, table = _Worker.sources[task.source], _Worker.tables[task.source]
    n = len(task.items)
    status = np.full(n, BAD, dtype=np.int8)
    ids: List[Optional[str]] = [None] * n
    trailing = np.zeros(n, dtype=bool)
    bad: List[Tuple[int, Optional[int], Optional[int], BadRow, Any]] = []
    convs, rows = [], []
    for k, item in enumerate(task.items):
        row = item if isinstance(item, RawRow) else row_of(task.path, item, _Worker.limit)
        if not keeps(row, source):
            status[k] = OTHER
            continue
        try:
            conv = conversation_of(row, source, table)
        except BadRow as exc:
            raw = row.raw_text if row.error is not None else row.value
            bad.append((k, row.loc, row.element, exc, raw))
            continue
        ids[k], trailing[k] = conv.id, conv.dropped_turns > 0
        convs.append(conv)
        rows.append(k)
    batch = _Worker.encoder.encode_arrays(convs)
    lengths = np.zeros(n, dtype=np.int64)
    truncated = np.zeros(n, dtype=bool)
    history_cut = np.zeros(n, dtype=bool)
    rows_arr = np.asarray(rows, dtype=np.int64)
    lengths[rows_arr], truncated[rows_arr] = batch.lengths, batch.truncated
    if batch.history_cut is not None:
        history_cut[rows_arr] = batch.history_cut
    status[rows_arr] = np.where(batch.lengths > 0, GOOD, DROPPED)
    for j, exc in batch.bad:
        status[rows[j]] = REFUSED
        bad.append((rows[j], convs[j].loc, convs[j].element, exc, conversation_dict(convs[j])))
    bad.sort(key=lambda b: b[0])
    return _Chunk(status, ids, trailing, lengths, truncated, batch.input_ids, batch.labels, bad,
                  _Worker.encoder.full_text, batch.per_segment, history_cut)


# ----------------------------------------------------------------------------------------------------------------
# The launching process


def read_and_encode(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig],
                    report: BadRowReport) -> Encoded:
    """Every source in order (see the module comment); bad rows go to `report` (which may raise)."""
    caps = _Caps(cfg.dataset, sources)
    limit = cfg.dataset.max_row_bytes
    workers = max(1, cfg.data.preprocess_workers)
    init = (tokenizer, cfg, list(sources), workers > 1)
    out = _Collector()
    if workers == 1:
        _init_worker(*init)
        for task, chunk in _ordered(_encode_chunk, _tasks(sources, caps, limit), 1, lambda _t, res: res):
            out.add(task, chunk, sources, caps, report)
        return out.result()
    # A worker that dies (the OOM killer's SIGKILL) or stays silent ends the preparation with one message; every
    # wait on a worker is bounded (prep_pool.py); a refused row (bad_rows=error) lets only the running chunks finish.
    pool = PreparationPool(workers, _encode_chunk, _init_worker, init)
    try:
        for task, chunk in _ordered(pool.submit, _tasks(sources, caps, limit), workers * AHEAD, pool.take):
            out.add(task, chunk, sources, caps, report)
    finally:
        pool.close()
    return out.result()


class _Caps:
    """Conversations taken per source and overall, against `sources[i].max_samples` and `dataset.max_samples`."""

    def __init__(self, dataset: DatasetConfig, sources: Sequence[SourceConfig]):
        self.total_cap = dataset.max_samples
        self.caps = [s.max_samples for s in sources]
        self.taken = [0] * len(sources)
        self.any = self.total_cap is not None or any(c is not None for c in self.caps)

    def room(self, source: int) -> Optional[int]:
        """Conversations this source may still give (None: no cap)."""
        left = [c - t for c, t in ((self.caps[source], self.taken[source]),
                                   (self.total_cap, sum(self.taken))) if c is not None]
        return max(0, min(left)) if left else None

    def closed(self, source: int) -> bool:
        return self.any and self.room(source) == 0

    def all_closed(self) -> bool:
        """`dataset.max_samples` reached: later sources are not even looked at (nor their missing patterns)."""
        return self.total_cap is not None and sum(self.taken) >= self.total_cap


def _tasks(sources: Sequence[SourceConfig], caps: _Caps, limit: int) -> Iterator[_Task]:
    """Chunks of rows in source and file order; stops reading a source once its cap is reached, and after a
    broken file (its task carries the error)."""
    for i, source in enumerate(sources):
        if caps.all_closed():
            return
        files, missing = expand_paths(source.paths)
        for pattern in missing:
            yield _Task(i, pattern, missing=True)
        for path in files:
            if caps.closed(i):
                break
            task = _Task(i, path)
            broken = None
            try:
                for item in read_row_items(path, limit, used_columns(source)):
                    if not task.items and caps.closed(i):
                        break
                    task.items.append(item)
                    task.size += len(item[1] or b"") if isinstance(item, tuple) else 0
                    if len(task.items) == CHUNK or task.size >= CHUNK_BYTES:
                        yield task
                        task = _Task(i, path)
            except FileUnreadable as exc:
                broken = exc
            if task.items:
                yield task
            if broken is not None:  # the collector raises it, unless this source's cap was reached before it
                yield _Task(i, path, broken=broken)
                break


def _ordered(submit: Callable[[_Task], Any], tasks: Iterator[_Task], ahead: int,
             take: Callable[[_Task, Any], Any]) -> Iterator[Tuple[_Task, Any]]:
    """(task, result) in task order, at most `ahead` tasks in flight; `submit` returns a key (or, with ahead=1, the
    result itself) and `take(task, what submit returned)` the result."""
    pending: deque = deque()
    for task in tasks:
        if task.local:
            pending.append((task, None))
        else:
            pending.append((task, submit(task)))
        while len(pending) >= ahead or (pending and pending[0][1] is None):
            task0, res = pending.popleft()
            yield task0, res if res is None else take(task0, res)
    while pending:
        task0, res = pending.popleft()
        yield task0, res if res is None else take(task0, res)


class _Collector:
    """Applies chunks in order: caps, bad-row policy, then keeps the conversations' tokens."""

    def __init__(self) -> None:
        self.parts: List[Tuple[np.ndarray, ...]] = []
        self.ids: List[str] = []
        self.sources: List[str] = []
        self.dropped: List[int] = []
        self.one_text, self.per_segment, self.history_cut = True, 0, 0

    def add(self, task: _Task, chunk: Optional[_Chunk], sources: Sequence[SourceConfig], caps: _Caps,
            report: BadRowReport) -> None:
        source = sources[task.source]
        if task.broken is not None:
            if not caps.closed(task.source) and not caps.all_closed():
                raise task.broken
            return  # past the cap: a sequential read would not have got that far
        if chunk is None:  # a pattern matching no file
            if caps.all_closed():
                return
            report.rows_read += 1
            why = BadRow(BadReason.no_matching_path, f"source {source.name!r}: {no_file(task.path)}")
            report.add(task.path, None, why)
            return
        if caps.closed(task.source):
            return  # read ahead past the cap: never counted
        is_conv = (chunk.status != BAD) & (chunk.status != OTHER)
        room, cut = caps.room(task.source), len(chunk.status)
        taken = np.cumsum(is_conv)
        if room is not None and len(taken) and taken[-1] >= room:
            cut = int(np.searchsorted(taken, room)) + 1 if room else 0
        report.rows_read += cut - int((chunk.status[:cut] == OTHER).sum())
        for k, loc, element, exc, raw in chunk.bad:
            if k < cut:
                report.add(task.path, loc, exc, raw, element)
        report.trailing_turns_dropped += int(chunk.trailing[:cut].sum())
        rows = np.flatnonzero(is_conv[:cut])
        caps.taken[task.source] += len(rows)
        first = len(self.ids)
        self.ids += [chunk.ids[k] for k in rows]
        self.sources += [source.name] * len(rows)
        self.dropped += [first + j for j, k in enumerate(rows) if chunk.status[k] == DROPPED]
        self.one_text, self.per_segment = chunk.one_text, self.per_segment + chunk.per_segment
        self.history_cut += int(chunk.history_cut[rows].sum()) if chunk.history_cut is not None else 0
        n_tokens = int(chunk.lengths[:cut].sum())
        self.parts.append((chunk.input_ids[:n_tokens], chunk.labels[:n_tokens], chunk.lengths[rows],
                           chunk.truncated[rows]))

    def result(self) -> Encoded:
        cat = (lambda k, dt: np.concatenate([p[k] for p in self.parts]) if self.parts else np.zeros(0, dt))
        lengths = cat(2, np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
        return Encoded(cat(0, np.int32), cat(1, np.int32), starts, lengths, cat(3, bool),
                       np.flatnonzero(lengths > 0), self.dropped, self.ids, self.sources, self.one_text,
                       self.per_segment, self.history_cut)
