"""Parquet files read row by row (map preparation, and `dsrecipes shard`, which reads as map preparation does).

A Parquet file is a sequence of rows where row N (1-based) plays the role of line N of a JSON-lines file: each row
becomes the JSON text of the dict its columns make (`{"conversations": [{"from": ..., "value": ...}], "system": ...}`)
and goes through `files.parse_row` like a line's bytes, so every check, id (`<file name>:N`), position (`file:N`),
bad-row reason and the row limit (`dataset.max_row_bytes`, on the row's JSON text) are those of JSON lines. A null
column or struct field (a row without `system`, a turn without `weight` where another has one: Parquet gives every
row every column) is left out, as absent from a JSON row. Rows are read `BATCH_ROWS` at a time
(`ParquetFile.iter_batches`): memory holds one row group's column data and one batch of rows as Python values,
never the whole table.

Values JSON cannot carry (bytes, timestamps, dates, decimals, ...) in a column the source reads
(`files.used_columns`) are one DataError naming the file, the row and the column; such a column that no reader looks
at (an image column beside `conversations`) is left out of the rows. A file pyarrow cannot read (not Parquet,
truncated, a corrupt page) is `ParquetUnreadable`, raised by files.py as its `FileUnreadable` naming the file:
refused under both bad-row policies, like a broken `.json` array.
"""

from __future__ import annotations

import json
from typing import Any, Collection, Dict, Iterator, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from dsrecipes.core.errors import DataError
from dsrecipes.data.sources.remote import is_url, open_bytes

BATCH_ROWS = 1024
_ERRORS = (pa.ArrowException, OSError, UnicodeDecodeError, ValueError)


class ParquetUnreadable(Exception):
    """(where, what): a file pyarrow cannot read to its end; files.py raises it as its FileUnreadable."""

    def __init__(self, where: str, what: str):
        super().__init__(where, what)
        self.where, self.what = where, what


def parquet_items(path: str, limit: int, used: Optional[Collection[str]] = None
                  ) -> Iterator[Tuple[int, Optional[bytes], None, None]]:
    """(row number N, the row's JSON bytes or None when longer than `limit`, None, None) of every row: the items of
    `files.read_row_items` for a Parquet file. `used`: the columns the caller reads (None: all of them)."""
    fh = open_bytes(path) if is_url(path) else None  # an object: its seekable reader (a seek, a ranged GET)
    try:
        try:
            pf = pq.ParquetFile(path if fh is None else fh)
        except _ERRORS as exc:
            raise ParquetUnreadable("before its first row", _what(exc)) from None
        with pf:
            yield from _rows(path, pf, limit, used)
    finally:
        if fh is not None:
            fh.close()


def _rows(path: str, pf: Any, limit: int, used: Optional[Collection[str]]
          ) -> Iterator[Tuple[int, Optional[bytes], None, None]]:
    """The rows of an open ParquetFile (see parquet_items)."""
    odd = {f.name: f.type for f in pf.schema_arrow if not _jsonable(f.type)}
    keep = [f.name for f in pf.schema_arrow if f.name not in odd or used is None or f.name in used]
    nested = {f.name for f in pf.schema_arrow if f.name in keep and _has_struct(f.type)}
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
        for row in rows:
            n += 1
            row = {k: _absent_nulls(v) if k in nested else v for k, v in row.items() if v is not None}
            data = _row_bytes(path, n, row, odd)
            yield n, (None if len(data) > limit else data), None, None


def _row_bytes(path: str, n: int, row: Dict[str, Any], odd: Dict[str, pa.DataType]) -> bytes:
    try:
        return json.dumps(row, ensure_ascii=False).encode("utf-8", "surrogatepass")
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


def _has_struct(kind: pa.DataType) -> bool:
    t = pa.types
    if t.is_list(kind) or t.is_large_list(kind) or t.is_fixed_size_list(kind) or t.is_dictionary(kind):
        return _has_struct(kind.value_type)
    return t.is_struct(kind)


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
    t = pa.types
    if t.is_dictionary(kind):
        return _jsonable(kind.value_type)
    if t.is_list(kind) or t.is_large_list(kind) or t.is_fixed_size_list(kind):
        return _jsonable(kind.value_type)
    if t.is_struct(kind):
        return all(_jsonable(kind.field(i).type) for i in range(kind.num_fields))
    return (t.is_string(kind) or t.is_large_string(kind) or t.is_integer(kind) or t.is_boolean(kind)
            or t.is_null(kind) or t.is_float32(kind) or t.is_float64(kind))


def _what(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"not a readable Parquet file: {text}"
