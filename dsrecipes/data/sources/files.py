"""Conversation files: which files a source names, and their rows read one by one with bounded memory.

Files are `.jsonl` (one row per line) or `.json` (an array of rows, or JSON lines / one object), optionally `.gz`.
Every row goes through `parse_row`, the one place that turns bytes into a row value; a row that cannot be used is
returned with the reason (`RawRow.error`), never raised, so the bad-row policy decides:
  too_large     more than `dataset.max_row_bytes` bytes: skipped while reading, never held whole
  too_deep      brackets nested deeper than MAX_DEPTH (or deep enough to exhaust Python's recursion)
  invalid_utf8 / invalid_json   bytes that are not UTF-8 / not JSON
  invalid_text  valid JSON holding a lone UTF-16 surrogate (`\\ud800`): not text, tokenizers refuse it
A file that cannot be read to its end (truncated or corrupt gzip, plain text named `.gz`, a JSON array whose
structure breaks) raises `FileUnreadable`, naming the file and how far reading got: the rows after the break cannot
be counted, so no bad-row policy can account for them.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import re
import zlib
from array import array
from dataclasses import dataclass
from typing import IO, Any, Callable, Collection, Iterator, List, Optional, Tuple, Union

from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import DEFAULT_MAX_ROW_BYTES
from dsrecipes.data.sources.badrows import BadReason, BadRow, location
from dsrecipes.data.sources.formats import PARQUET_MAGIC, other_format, refuse_other_format
from dsrecipes.data.sources.jsonscan import BOM, JsonStructureError, values
from dsrecipes.data.sources.remote import expand as remote_expand
from dsrecipes.data.sources.remote import is_url, looks_like_url, open_maybe_gzip

MAX_DEPTH = 100  # conversations need ~5 levels; far deeper rows only exhaust recursion in the code after the parse
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_READ_ERRORS = (EOFError, OSError, zlib.error)  # gzip.BadGzipFile is an OSError


class FileUnreadable(DataError):
    """A file whose rows cannot all be read; refused under both bad-row policies."""

    def __init__(self, path: str, where: str, what: str):
        fix = "re-download or repair it (`gzip -t FILE` tests a .gz)" if path.endswith(".gz") else "repair it"
        super().__init__(
            f"{path}: unreadable {where} ({what}); the rows after that point cannot be read or counted, so the file "
            f"is refused under both dataset.bad_rows policies: {fix}, or leave it out of the dataset")


@dataclass
class RawRow:
    """One row as read from a file: `value` is the parsed JSON, or `error` says why it could not be used."""

    path: str
    loc: Optional[int]  # 1-based line where the row starts; None: the whole file
    value: Any = None
    error: Optional[BadRow] = None
    raw_text: Optional[str] = None  # the undecodable/unparsable text, for the quarantine
    element: Optional[int] = None  # 0-based index of the row in a JSON array

    @property
    def default_id(self) -> str:
        return f"{os.path.basename(self.path)}:{self.loc if self.element is None else self.element}"

    @property
    def where(self) -> str:
        return location(self.path, self.loc, self.element)


def expand_paths(patterns: List[str], *, parquet: bool = True) -> Tuple[List[str], List[str]]:
    """(files, patterns matching nothing): each glob sorted, duplicates removed, in pattern order. A URL
    (`remote.is_url`) is listed in its store; a store that cannot be asked raises DataError, and so does a file that
    is not rows we read (a CSV file; Parquet where `parquet` is False: data=iterable's index of byte offsets;
    `formats.refuse_other_format`, by its first bytes, by name in a store)."""
    files: List[str] = []
    missing: List[str] = []
    for pattern in patterns:
        if looks_like_url(pattern):
            matches = remote_expand(pattern)
        else:
            matches = sorted(m for m in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(m))
        if not matches:
            missing.append(pattern)
        for m in matches:
            refuse_other_format(m, remote=is_url(m), parquet=parquet)
        files += [m for m in matches if m not in files]
    return files, missing


def no_file(pattern: str) -> str:
    """Why `pattern` yields no data file, for messages: a directory is named as such (its files must be named)."""
    if looks_like_url(pattern):
        return f"{pattern!r} matches no object"
    if os.path.isdir(os.path.expanduser(pattern)):
        return f"{pattern!r} is a directory: name its files (e.g. '{pattern.rstrip('/')}/*.jsonl')"
    others = glob.glob(os.path.expanduser(pattern))  # stat only: a FIFO is never opened (its reader would block)
    if others == [os.path.expanduser(pattern)]:
        return f"{pattern!r} {_not_regular(others[0])}: name a data file"
    if others:
        return f"{pattern!r} matches no regular file ({others[0]!r} {_not_regular(others[0])})"
    return f"{pattern!r} matches no file"


def _not_regular(path: str) -> str:
    if os.path.islink(path) and not os.path.exists(path):
        return f"is a symbolic link to {os.readlink(path)!r}, which does not exist (or a loop of links)"
    return "is a directory" if os.path.isdir(path) else "is not a regular file (a FIFO, socket or device)"


def where(path: str, line: Optional[int], element: Optional[int]) -> str:
    """`location()` of a row, the line of a JSON array's element looked up when only the element is known (a
    stream reads arrays through a converted copy that keeps elements, not lines)."""
    if element is not None and line is None:
        line = element_line(path, element)
    return location(path, line, element)


def element_line(path: str, element: int) -> Optional[int]:
    """The line where element `element` of the JSON array in `path` starts: one scan of the file the first time
    (8 bytes per element are kept, for the file asked about last); for messages."""

    if _element_lines.get("path") != path:
        lines = array("q")
        try:
            with open_maybe_gzip(path) as fh:
                lines.extend(v.line for v in values(fh, 0) if v.element is not None)
        except (JsonStructureError, *_READ_ERRORS):
            pass
        _element_lines.update(path=path, lines=lines)
    lines = _element_lines["lines"]
    return lines[element] if 0 <= element < len(lines) else None


_element_lines: dict = {}


def _is_json_file(path: str) -> bool:
    name = path[:-3] if path.endswith(".gz") else path
    return name.endswith(".json")


# ---------------------------------------------------------------------------------------------------------------
# One row


def parse_row(path: str, line: int, data: Optional[bytes], element: Optional[int] = None, *,
              limit: int = DEFAULT_MAX_ROW_BYTES, depth: Optional[int] = None) -> RawRow:
    """Bytes of one row -> RawRow (value, or the reason it cannot be used). `data=None`: the row was longer than
    `limit` bytes and was skipped while reading. `depth`: the bracket depth when the reader already knows it."""
    if data is None:
        return RawRow(path, line, error=BadRow(BadReason.too_large, f"longer than dataset.max_row_bytes={limit}"),
                      element=element)
    if line == 1 and element is None and data.startswith(BOM):  # a file's UTF-8 BOM, as every reader sees it
        data = data[len(BOM):]
    if depth is None and data.count(b"[") + data.count(b"{") > MAX_DEPTH:
        depth = json_depth(data)
    if depth is not None and depth > MAX_DEPTH:
        return RawRow(path, line, error=BadRow(BadReason.too_deep, f"brackets nested {depth} deep (> {MAX_DEPTH})"),
                      element=element)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRow(path, line, error=BadRow(BadReason.invalid_utf8, str(exc)),
                      raw_text=data.decode("utf-8", errors="replace").rstrip("\r\n"), element=element)
    try:
        value = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and an integer of more than sys.get_int_max_str_digits() digits
        return RawRow(path, line, error=BadRow(BadReason.invalid_json, str(exc)), raw_text=text.rstrip("\r\n"),
                      element=element)
    except RecursionError:
        return RawRow(path, line, error=BadRow(BadReason.too_deep, "nested too deep to parse"), element=element)
    if _SURROGATE_ESCAPE.search(data) and _has_lone_surrogate(value):
        return RawRow(path, line, error=BadRow(BadReason.invalid_text, "a string holds a lone UTF-16 surrogate "
                                               "(an unpaired \\ud800-\\udfff escape)"),
                      raw_text=text.rstrip("\r\n"), element=element)
    return RawRow(path, line, value=value, element=element)


def json_depth(data: bytes) -> int:
    """The deepest bracket nesting of JSON bytes (strings skipped); a cheap pre-check before parsing."""

    try:
        return max((v.depth for v in values(io.BytesIO(data), len(data), array=False)), default=0)
    except JsonStructureError:
        return 0  # not balanced: the parser reports it as invalid_json


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, list):
            stack += v
    return False


# ---------------------------------------------------------------------------------------------------------------
# Rows of a file


# (line where the row starts, its bytes or None: longer than the limit, JSON array element, bracket depth if known;
# a Parquet row's: its schema's, a bound within MAX_DEPTH, which is all parse_row asks of it)
RowItem = Tuple[Optional[int], Optional[bytes], Optional[int], Optional[int]]


def read_rows(path: str, limit: int = DEFAULT_MAX_ROW_BYTES, columns: Optional[Collection[str]] = None
              ) -> Iterator[RawRow]:
    """Every row of one file, parsed or with the reason it cannot be used (an empty file yields one bad RawRow).
    Raises FileUnreadable when the file breaks before its end. `columns`: see `read_row_items`."""
    for item in read_row_items(path, limit, columns):
        yield item if isinstance(item, RawRow) else row_of(path, item, limit)


def read_row_items(path: str, limit: int = DEFAULT_MAX_ROW_BYTES, columns: Optional[Collection[str]] = None
                   ) -> Iterator[Union[RowItem, RawRow]]:
    """`read_rows` with the parsing left to the caller (`row_of`, e.g. in a worker process): the bytes of every row
    as the bounded readers cut them (a row over `limit` is None, never held whole), a RawRow for an empty file.
    A Parquet file's row N is line N, its bytes the row's JSON text (parquet_rows.py); `columns`: the columns the
    caller reads (`used_columns`), where a Parquet column JSON cannot carry is refused, else left out.
    Raises FileUnreadable when the file breaks before its end."""
    any_row = False
    for item in _items(path, limit, columns):
        any_row = True
        yield item
    if not any_row:
        yield RawRow(path, None, error=BadRow(BadReason.empty_file, "no rows"))


EXTRA_COLUMNS = ("margin",)  # read by name outside a source's `columns` (preference.py: a reward model's target gap)
# row_shapes.py's `completion` (TRL's prompt/completion rows), read from Parquet for dataset.format=openai only: a
# Parquet row is its read columns, so another format keeps the row (and its dataset.split row id) it had before
OPENAI_COLUMNS = ("completion",)


def used_columns(source: Any) -> frozenset:
    """The top-level columns a reader of `source` looks at: its `columns` mapping, EXTRA_COLUMNS and, for
    dataset.format=openai, OPENAI_COLUMNS."""
    cols = source.columns
    extra = EXTRA_COLUMNS + (OPENAI_COLUMNS if getattr(source.format, "value", None) == "openai" else ())
    return frozenset({getattr(cols, f.name) for f in dataclasses.fields(cols)} | set(extra))


def _items(path: str, limit: int, columns: Optional[Collection[str]]) -> Iterator[RowItem]:
    if is_url(path):  # an object in a store: by its name, as expand_paths judged it (no byte is fetched for this)
        fh = None if other_format(path, remote=True) == "parquet" else open_maybe_gzip(path)
    else:
        fh = _open_local(path)
    if fh is None:  # Parquet
        import dsrecipes.data.sources.parquet_rows as parquet_rows  # lazy: pyarrow only for Parquet files

        try:
            yield from parquet_rows.parquet_items(path, limit, columns, MAX_DEPTH)
        except parquet_rows.ParquetUnreadable as exc:
            raise FileUnreadable(path, exc.where, exc.what) from None
        return
    with fh:
        if _is_json_file(path):
            yield from _json_items(path, fh, limit)
        else:
            yield from ((n, data, None, None) for n, data in iter_lines(fh, limit, path))


def _open_local(path: str) -> Optional[IO[bytes]]:
    """The reader of a local file of JSON rows, or None for a Parquet file: judged by the reader's own first bytes
    as formats.other_format judges them, so that a file is opened to be read, not first once more to be sniffed
    (expand_paths sniffed it when it listed it)."""
    fh = open_maybe_gzip(path)
    try:
        head = fh.peek(len(PARQUET_MAGIC))  # type: ignore[attr-defined]  # BufferedReader, GzipFile
    except _READ_ERRORS:  # a fresh reader reports it where it reads (other_format: None, not Parquet)
        fh.close()
        return open_maybe_gzip(path)
    if len(head) < len(PARQUET_MAGIC):  # fewer bytes than the magic (a tiny file, a short gzip member): the sniff
        parquet = other_format(path) == "parquet"
    else:
        parquet = head.startswith(PARQUET_MAGIC)
    if parquet:
        fh.close()
        return None
    return fh


def row_of(path: str, item: RowItem, limit: int = DEFAULT_MAX_ROW_BYTES) -> RawRow:
    """One item of `read_row_items` -> RawRow (`parse_row`: every check of a row)."""
    line, data, element, depth = item
    return parse_row(path, line, data, element, limit=limit, depth=depth)


def iter_lines(fh: IO[bytes], limit: int, path: str) -> Iterator[Tuple[int, Optional[bytes]]]:
    """(1-based line, bytes without the line end) of every non-blank line; bytes None for a line longer than
    `limit` (skipped in pieces, never held whole). Raises FileUnreadable when the file breaks."""
    line_no = 0
    try:
        while True:
            data = fh.readline(limit + 1)
            if not data:
                return
            line_no += 1
            if line_no == 1 and data.startswith(BOM):
                data = data[len(BOM):]
            if len(data) > limit and not data.endswith(b"\n"):
                while data and not data.endswith(b"\n"):
                    data = fh.readline(1 << 20)
                yield line_no, None
                continue
            if data.isspace() or not data:
                continue
            yield line_no, data.rstrip(b"\r\n")
    except _READ_ERRORS as exc:
        raise FileUnreadable(path, f"after line {line_no}" if line_no else "before its first line",
                             read_error(exc)) from None


def lines_in_range(read: Callable[[int, int], bytes], start: int, stop: int, limit: int) -> Iterator[Optional[bytes]]:
    """The lines of bytes [start, stop) of a file, read in pieces by `read(offset, end)`: b"" for a blank line, None
    for a non-blank line longer than `limit` (never held whole). For a block that holds such a line."""
    piece, pos = 1 << 20, start
    line: List[bytes] = []
    size, over, nonblank = 0, False, False
    while pos < stop:
        data = read(pos, min(stop, pos + piece))
        if not data:
            break
        pos += len(data)
        parts = data.split(b"\n")
        for k, part in enumerate(parts):
            size += len(part)
            nonblank = nonblank or bool(part.strip())
            over = over or size > limit
            if not over:
                line.append(part)
            if k < len(parts) - 1 or pos >= stop:
                yield (None if nonblank else b"") if over else (b"".join(line) if nonblank else b"")
                line, size, over, nonblank = [], 0, False, False


def _json_items(path: str, fh: IO[bytes], limit: int) -> Iterator[RowItem]:
    read = 0
    try:
        for v in values(fh, limit):
            read += 1
            yield v.line, v.data, v.element, v.depth
    except JsonStructureError as exc:
        raise FileUnreadable(path, f"at line {exc.line}, after {exc.values_read} rows",
                             f"broken JSON: {exc.message}") from None
    except _READ_ERRORS as exc:
        raise FileUnreadable(path, f"after {read} rows", read_error(exc)) from None


def read_error(exc: BaseException) -> str:
    """What a failed read of a (maybe gzip) file means, in words."""
    text = " ".join(str(exc).split())
    if isinstance(exc, gzip.BadGzipFile) and text.startswith("Not a gzipped file"):
        return "not gzip-compressed, although its name ends in .gz"
    if isinstance(exc, EOFError):
        return f"truncated: {text or 'ended early'}"
    if isinstance(exc, (gzip.BadGzipFile, zlib.error)):
        return f"corrupt compressed data: {text}"
    return f"{type(exc).__name__}: {text or 'unreadable'}"
