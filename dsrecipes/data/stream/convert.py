"""JSON arrays and gzip made seekable for `data=iterable`: converted once, streaming, into a cached JSONL.

A reader seeks to its blocks, which a gzip stream and a JSON array cannot offer. `.jsonl.gz` is decompressed; a `.json`
array (or `.json.gz`) is split into its elements by `jsonscan.values` (structure only, streamed: memory is one chunk
whatever an element's size) and written one element per line, its raw bytes kept (only its newlines, which JSON
allows between tokens, become spaces), so line L of the copy is element L-1 of the original. A `.json` file of JSON
lines is read as JSONL, and one JSON value is one row, as `files.py` reads them for `data=map`. A file that breaks
(corrupt or truncated gzip, broken JSON structure) raises `files.FileUnreadable`: its rows cannot all be counted.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

from dsrecipes.core.fileio import atomic_writer
from dsrecipes.data.sources.files import FileUnreadable, read_error
from dsrecipes.data.sources.jsonscan import JsonStructureError, values
from dsrecipes.data.sources.remote import open_maybe_gzip

CHUNK = 1 << 20
_NEWLINES = bytes.maketrans(b"\n\r", b"  ")


def file_kind(path: str) -> str:
    """`jsonl` (read in place), `jsonl.gz`, `json` or `json.gz` (candidates for conversion)."""
    name = path[:-3] if path.endswith(".gz") else path
    base = "json" if name.endswith(".json") else "jsonl"
    return base + (".gz" if path.endswith(".gz") else "")


Converted = Tuple[str, int, Any, Optional[Tuple[str, str]]]


def convert(path: str, out: Path, new_scanner: Callable[[], Any]) -> Converted:
    """Write the JSONL copy of `path` into `out` if it needs one, feeding its bytes to a scanner (`new_scanner()`).
    Returns (read path, loc_base, the scanner, or None when `path` itself is read as JSONL, problem). A file that
    breaks (corrupt or truncated gzip, broken JSON structure) raises files.FileUnreadable."""
    kind = file_kind(path)
    scanner = new_scanner()
    if kind == "jsonl.gz":
        _decompress(path, out, scanner)
        return str(out), 0, scanner, None
    count, array = _copy_values(path, out, scanner)
    if not array and count > 1:  # JSON lines in a .json file: read as JSONL (decompressed when gzipped)
        out.unlink(missing_ok=True)
        if kind == "json.gz":
            scanner = new_scanner()
            _decompress(path, out, scanner)
            return str(out), 0, scanner, None
        return path, 0, None, None
    return str(out), -1, scanner, None


def _decompress(path: str, out: Path, scanner: Any) -> None:
    try:
        with atomic_writer(out) as fh, open_maybe_gzip(path) as src:
            for block in iter(lambda: src.read(1 << 16), b""):  # small reads: a break is located closely
                fh.write(block)
                scanner.feed(block)
    except (OSError, EOFError, zlib.error) as exc:
        where = f"after line {scanner.line_no}" if scanner.line_no else "before its first line"
        raise FileUnreadable(path, where, read_error(exc)) from None


def _copy_values(path: str, out: Path, scanner: Any) -> Tuple[int, bool]:
    """(values, whether they were the elements of an array): every top-level value of `path` written onto one line
    of `out`, streamed through in pieces (jsonscan.py: memory is one chunk, whatever the element's size)."""

    count, array = 0, False
    try:
        with atomic_writer(out) as fh, open_maybe_gzip(path) as src:
            def sink(piece: bytes) -> None:
                piece = piece.translate(_NEWLINES)  # JSON allows them between tokens only: the value stays the same
                fh.write(piece)
                scanner.feed(piece)

            for value in values(src, 0, sink=sink):
                fh.write(b"\n")
                scanner.feed(b"\n")
                count, array = count + 1, value.element is not None
    except JsonStructureError as exc:
        raise FileUnreadable(path, f"at line {exc.line}, after {exc.values_read} rows",
                             f"broken JSON: {exc.message}") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise FileUnreadable(path, f"after {count} rows", read_error(exc)) from None
    return count, array
