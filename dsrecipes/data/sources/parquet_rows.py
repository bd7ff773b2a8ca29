"""Parquet files read row by row (map preparation, and `dsrecipes shard`, which reads as map preparation does).

A Parquet file is a sequence of rows where row N (1-based) plays the role of line N of a JSON-lines file: each row
becomes the JSON text of the dict its columns make (`{"conversations": [{"from": ..., "value": ...}], "system": ...}`)
and goes through `files.parse_row` like a line's bytes, so every check, id (`<file name>:N`), position (`file:N`),
bad-row reason and the row limit (`dataset.max_row_bytes`, on the row's JSON text) are those of JSON lines. A null
column or struct field (a row without `system`, a turn without `weight` where another has one: Parquet gives every
row every column) is left out, as absent from a JSON row. Rows are read `BATCH_ROWS` at a time
(`ParquetFile.iter_batches`), column chunks through a `READ_BUFFER` buffer: memory holds one batch of rows as Arrow
and Python values, not a row group's column chunks (pd.to_parquet writes up to a million rows in one) nor the table.

The JSON text costs a Parquet row more than a JSON line (20,000 ShareGPT conversations, CPU time of files.read_rows:
about 2.5x the JSON-lines file's; 3.6-4x before ASCII batches were encoded with ensure_ascii, which gives the same text
there, rows of a schema no deeper than files.MAX_DEPTH were handed their depth, and struct nulls looked for per batch);
what remains is Arrow decoding, to_pylist and the JSON text itself, which the row limit and the checks of
`parse_row` are taken on, as for every row.

Values JSON cannot carry (bytes, timestamps, dates, decimals, ...) in a column the source reads
(`files.used_columns`) are one DataError naming the file, the row and the column; such a column that no reader looks
at (an image column beside `conversations`) is left out of the rows. A file pyarrow cannot read (not Parquet,
truncated, a corrupt page) is `ParquetUnreadable`, raised by files.py as its `FileUnreadable` naming the file:
refused under both bad-row policies, like a broken `.json` array.
"""

from __future__ import annotations

import json
from typing import Any, Collection, Dict, Iterator, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from dsrecipes.core.errors import DataError
from dsrecipes.data.sources.remote import is_url, open_bytes

BATCH_ROWS = 1024
# Column chunks are read through a buffer this large, not read ahead whole (pyarrow's pre_buffer): else a row group's
# columns are held compressed in memory while its rows are read, and pd.to_parquet writes up to a million rows in one
# (a 110 MiB row group: arrow memory peaked at 121 MiB; so, at 13 MiB).
READ_BUFFER = 1 << 20
_ENCODER = json.JSONEncoder(ensure_ascii=False)  # json.dumps(row, ensure_ascii=False), without a new encoder per row
# The same text where no string or name holds a character from DEL (0x7f) up (the only ones ensure_ascii escapes
# and the other leaves), made faster (a row's size, ids and quarantined text are those of the text above).
_ASCII = json.JSONEncoder(ensure_ascii=True)
_ERRORS = (pa.ArrowException, OSError, UnicodeDecodeError, ValueError)


class ParquetUnreadable(Exception):
    """(where, what): a file pyarrow cannot read to its end; files.py raises it as its FileUnreadable."""

    def __init__(self, where: str, what: str):
        super().__init__(where, what)
        self.where, self.what = where, what


def parquet_items(path: str, limit: int, used: Optional[Collection[str]] = None, max_depth: int = 0
                  ) -> Iterator[Tuple[int, Optional[bytes], None, Optional[int]]]:
    """(row number N, the row's JSON bytes or None when longer than `limit`, None, its schema's depth where that is
    at most `max_depth` (files.MAX_DEPTH), else None) of every row: the items of `files.read_row_items` for a Parquet
    file. `used`: the columns the caller reads (None: all of them)."""
    fh = open_bytes(path) if is_url(path) else None  # an object: its seekable reader (a seek, a ranged GET)
    try:
        try:
            pf = pq.ParquetFile(path if fh is None else fh, buffer_size=READ_BUFFER, pre_buffer=False)
        except _ERRORS as exc:
            raise ParquetUnreadable("before its first row", _what(exc)) from None
        with pf:
            yield from _rows(path, pf, limit, used, max_depth)
    finally:
        if fh is not None:
            fh.close()


def _rows(path: str, pf: Any, limit: int, used: Optional[Collection[str]], max_depth: int
          ) -> Iterator[Tuple[int, Optional[bytes], None, Optional[int]]]:
    """The rows of an open ParquetFile (see parquet_items)."""
    odd = {f.name: f.type for f in pf.schema_arrow if not _jsonable(f.type)}
    keep = [f.name for f in pf.schema_arrow if f.name not in odd or used is None or f.name in used]
    nested = {f.name for f in pf.schema_arrow if f.name in keep and _has_struct(f.type)}
    # No row is deeper than its schema: within max_depth, parse_row is told so and need not count its brackets (a
    # row it would find too deep cannot occur); else it counts them, as for a JSON line.
    bound = 1 + max((_depth(f.type) for f in pf.schema_arrow if f.name in keep), default=0)
    depth = bound if bound <= max_depth else None
    plain_names = all(_plain_text(name) for name in _names(pf.schema_arrow))
    n = 0
    batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=keep)
    while True:
        try:
            batch = next(batches, None)
            rows = [] if batch is None else batch.to_pylist()
        except _ERRORS as exc:
            raise ParquetUnreadable(f"after row {n}" if n else "before its first row", _what(exc)) from None
        if batch is None:
            return
        holes = {k for k in nested if _null_field(batch.column(k))}  # struct fields to leave out: none, mostly
        encoder = _ASCII if plain_names and all(_plain(column) for column in batch.columns) else _ENCODER
        for row in rows:
            n += 1
            row = {k: _absent_nulls(v) if k in holes else v for k, v in row.items() if v is not None}
            data = _row_bytes(path, n, row, odd, encoder)
            yield n, (None if len(data) > limit else data), None, depth


def _row_bytes(path: str, n: int, row: Dict[str, Any], odd: Dict[str, pa.DataType],
               encoder: json.JSONEncoder = _ENCODER) -> bytes:
    try:
        return encoder.encode(row).encode("utf-8", "surrogatepass")
    except (TypeError, ValueError):
        pass
    for name, kind in odd.items():
        try:
            json.dumps(row.get(name))
        except (TypeError, ValueError):
            value = _first_odd(row.get(name))
            raise DataError(
                f"{path}:{n}: column {name!r} holds {type(value).__name__} values (Parquet type {kind}), which a "
                f"JSON row cannot carry; write that column as text (pyarrow: table.column({name!r})"
                ".cast(pa.string())), or map the source's fields to other columns") from None
    raise DataError(f"{path}:{n}: the row cannot be written as JSON")  # not reached: every odd type is in `odd`


def _absent_nulls(value: Any) -> Any:
    """`value` with the null fields of its structs left out (in a JSON row the field is absent: a null `weight`
    would be a bad value)."""
    if isinstance(value, list):
        return [_absent_nulls(v) for v in value]
    if isinstance(value, dict):
        return {k: _absent_nulls(v) for k, v in value.items() if v is not None}
    return value


def _nested(values: pa.Array) -> Iterator[pa.Array]:
    """`values` and every array inside it: a dictionary's values, a list's values, a struct's fields (those of no
    row included)."""
    t = pa.types
    stack = [values]
    while stack:
        array = stack.pop()
        yield array
        kind = array.type
        if t.is_dictionary(kind):
            stack.append(array.dictionary)
        elif _is_list(kind):
            stack.append(array.values)
        elif t.is_struct(kind):
            stack.extend(array.field(i) for i in range(kind.num_fields))


def _null_field(values: pa.Array) -> bool:
    """Whether a struct inside `values` has a null field (at worst `_absent_nulls` runs for nothing)."""
    return any(pa.types.is_struct(a.type) and any(a.field(i).null_count for i in range(a.type.num_fields))
               for a in _nested(values))


def _plain(values: pa.Array) -> bool:
    """Whether no string inside `values` holds a character from DEL (0x7f) up (the buffers' bytes looked at: at
    worst the slower encoder is used for nothing)."""
    strings = (a for a in _nested(values) if pa.types.is_string(a.type) or pa.types.is_large_string(a.type))
    return all(a.buffers()[2] is None or _plain_text(a.buffers()[2].to_pybytes()) for a in strings)


def _plain_text(text: Any) -> bool:
    return text.isascii() and ("\x7f" if isinstance(text, str) else b"\x7f") not in text


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _parts(kind: pa.DataType) -> Optional[List[pa.DataType]]:
    """The types a value of `kind` is made of: a dictionary's or a list's value type, a struct's field types; None
    for a type of single values. Every walk of a schema below goes through it."""
    if pa.types.is_dictionary(kind) or _is_list(kind):
        return [kind.value_type]
    if pa.types.is_struct(kind):
        return [kind.field(i).type for i in range(kind.num_fields)]
    return None


def _unwrapped(kind: pa.DataType) -> pa.DataType:
    """`kind` with its dictionaries and lists taken off (a list of structs: the struct)."""
    while pa.types.is_dictionary(kind) or _is_list(kind):
        kind = kind.value_type
    return kind


def _names(schema: Any) -> Iterator[str]:
    """The column and struct field names of `schema` (the keys of its rows' JSON)."""
    stack = [(f.name, f.type) for f in schema]
    while stack:
        name, kind = stack.pop()
        yield name
        kind = _unwrapped(kind)
        if pa.types.is_struct(kind):
            stack += [(kind.field(i).name, kind.field(i).type) for i in range(kind.num_fields)]


def _depth(kind: pa.DataType) -> int:
    """The deepest bracket nesting a value of `kind` has as JSON (a list or struct: one more than its values)."""
    parts = _parts(kind)
    if parts is None:
        return 0
    deepest = max(map(_depth, parts), default=0)
    return deepest if pa.types.is_dictionary(kind) else 1 + deepest


def _has_struct(kind: pa.DataType) -> bool:
    return pa.types.is_struct(_unwrapped(kind))


def _first_odd(value: Any) -> Any:
    """The first value inside `value` that JSON cannot carry (for the message)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack += v.values()
        elif isinstance(v, (list, tuple)):
            stack += v
        elif v is not None and not isinstance(v, (str, int, float, bool)):
            return v
    return value


def _jsonable(kind: pa.DataType) -> bool:
    """Whether every value of an Arrow type is a JSON value once `to_pylist` made it Python (a map is not: pairs)."""
    parts = _parts(kind)
    if parts is not None:
        return all(map(_jsonable, parts))
    t = pa.types
    return (t.is_string(kind) or t.is_large_string(kind) or t.is_integer(kind) or t.is_boolean(kind)
            or t.is_null(kind) or t.is_float32(kind) or t.is_float64(kind))


def _what(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"not a readable Parquet file: {text}"
