"""Which files hold rows we read, and the message for one that does not. Read: JSON (`.jsonl`, `.json`, each
optionally `.gz`) by every reader, and Parquet (`.parquet`/`.pq`, or any local file that starts with `PAR1`; hf://
paths are local files in the Hub cache, an s3:// object is read through its seekable reader) by map preparation and
`dsrecipes shard` (parquet_rows.py: row N is line N).
An Arrow, CSV/TSV or plain-text file read as JSON lines makes every row a bad row (`invalid_utf8`, `invalid_json`),
reported late and about rows rather than about the file; `expand_paths` asks `refuse_other_format` of every file it
lists, so every reader (map preparation, the stream index, `dsrecipes shard`) and `validate` refuse such a file by
name, with the command that converts it to JSON lines. So is Parquet where it is not read: by data=iterable (its
index keeps byte offsets of lines; `parquet=False`).

A local file is judged by its first bytes (Parquet's `PAR1`, Arrow's `ARROW1` or stream continuation marker), and a
`.csv`/`.tsv`/`.txt` one also by its first character: a row file starts with `{` or `[` (JSON under another name is
read as it always was). An object in a store is judged by its name only: no byte is fetched for this.
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
import zlib
from typing import Optional, Tuple

from dsrecipes.core.errors import DataError
from dsrecipes.data.sources.remote import looks_like_url

READ_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
READ_FORMATS = "JSON lines (.jsonl) or JSON (.json: an array of rows), either optionally gzip-compressed (.gz)"
_SNIFF_BYTES = 64
PARQUET_MAGIC = b"PAR1"  # a Parquet file's first (and last) bytes
_BINARY = ((PARQUET_MAGIC, "parquet"), (b"ARROW1", "feather"), (b"\xff\xff\xff\xff", "arrow"))
_BY_SUFFIX = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "feather", ".csv": "csv",
              ".tsv": "tsv", ".txt": "text", ".xlsx": "excel"}
_TEXT_KINDS = ("csv", "tsv", "text")  # may be JSON under another name: judged by the first character when local
_NAMES = {"parquet": "a Parquet file", "arrow": "an Arrow file (as `datasets` saves them)", "feather":
          "an Arrow IPC (Feather) file", "csv": "a CSV file", "tsv": "a TSV file", "text": "a plain-text file",
          "excel": "an Excel workbook"}  # and "gzip": see other_format_message
_READERS = {  # pandas reads each kind; text cells stay text (dtype=str), an empty cell stays "" (not null)
    "parquet": "pd.read_parquet({src})",
    "feather": "pd.read_feather({src})",
    "csv": "pd.read_csv({src}, dtype=str, keep_default_na=False)",
    "tsv": "pd.read_csv({src}, sep=\"\\t\", dtype=str, keep_default_na=False)",
    "excel": "pd.read_excel({src}, dtype=str, keep_default_na=False)",
}


def refuse_other_format(path: str, *, remote: bool = False, parquet: bool = True) -> None:
    """Raise DataError naming `path` when it is not a file of rows we read (see the module's docstring); `remote`:
    an object in a store, judged by its name; `parquet`: the caller reads local Parquet files (map preparation)."""
    kind = other_format(path, remote=remote)
    if kind == "parquet" and parquet:
        return
    if kind is not None:
        raise DataError(other_format_message(path, kind))


def other_format(path: str, *, remote: bool = False) -> Optional[str]:
    """The kind of a file that is not JSON rows (a key of _NAMES), or None: a file we read (or cannot tell)."""
    name, packed = _name(path)
    by_name = _BY_SUFFIX.get(os.path.splitext(name)[1].lower())
    if remote:
        return by_name if by_name not in (None, "text") else None  # a .txt object may hold JSON lines
    head = _head(path, packed)
    if head is None:
        return None  # unreadable here: the reader reports it (a corrupt gzip, a permission)
    for magic, kind in _BINARY:
        if head.startswith(magic):
            return kind
    if not packed and head.startswith(b"\x1f\x8b"):
        return "gzip"
    first = head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if by_name in _TEXT_KINDS and first and first not in b"{[":
        return by_name
    return None


def other_format_message(path: str, kind: str) -> str:
    name, _ = _name(path)
    out = os.path.splitext(os.path.basename(name) if looks_like_url(path) else name)[0] + ".jsonl"  # beside it
    if kind == "gzip":
        return (f"{path}: gzip-compressed, although its name does not end in .gz, so its rows would be read as "
                f"undecodable bytes; rename it to {path}.gz (a data file must be {READ_FORMATS})")
    if kind == "text":
        how = (f"a row is a JSON object, one per line (sharegpt `conversations`, openai `messages` or alpaca "
               f"`instruction`/`output`: dataset.format); write your examples as such rows into {out} and name that "
               "file instead")
    elif kind == "arrow":
        code = f"from datasets import Dataset; Dataset.from_file({json.dumps(path)}).to_json({json.dumps(out)})"
        how = f"convert it once: python -c {shlex.quote(code)} (a folder saved by save_to_disk: " \
              f"datasets.load_from_disk(FOLDER).to_json(...)), then name {out} instead"
    else:
        read = _READERS[kind].format(src=json.dumps(path))
        code = (f"import pandas as pd; {read}.to_json({json.dumps(out)}, orient=\"records\", lines=True, "
                "force_ascii=False)")
        how = f"convert it once: python -c {shlex.quote(code)}, then name {out} instead"
    if kind == "parquet":
        return (f"{path}: {_NAMES[kind]}; data=map reads Parquet, data=iterable indexes byte offsets of lines and "
                "does not: train on it with data=map (the default), `dsrecipes shard` it into JSON-lines parts for "
                f"data=presharded, or {how}; data=iterable reads {READ_FORMATS}")
    return (f"{path}: {_NAMES[kind]}, not rows dsrecipes reads; a data file must be {READ_FORMATS}: {how}")


def _name(path: str) -> Tuple[str, bool]:
    """(the name without `.gz`, whether it is gzip-compressed)."""
    return (path[:-3], True) if path.endswith(".gz") else (path, False)


def _head(path: str, packed: bool) -> Optional[bytes]:
    try:
        with (gzip.open(path, "rb") if packed else open(path, "rb")) as fh:
            return fh.read(_SNIFF_BYTES)
    except (OSError, EOFError, zlib.error):
        return None
