"""JSON arrays and gzip made seekable for `data=iterable`: converted once, streaming, into a cached JSONL.

A reader seeks to its blocks, which a gzip stream and a JSON array cannot offer. `.jsonl.gz` is decompressed; a `.json`
array (or `.json.gz`) is parsed element by element (`json.JSONDecoder.raw_decode` over a sliding buffer: memory is one
element plus one chunk) and written one element per line, its raw text kept (only its newlines, which JSON allows
between tokens, become spaces), so line L of the copy is element L-1 of the original. A `.json` file of JSON lines is
read as JSONL, and one JSON object is one row, as `files.py` reads them for `data=map`.
"""

from __future__ import annotations

import codecs
import gzip
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Tuple

from dsrecipes.fileio import atomic_writer

CHUNK = 1 << 20
MAX_ELEMENT_CHARS = 1 << 28  # a JSON element that does not parse within 256 Mi characters is reported broken


def file_kind(path: str) -> str:
    """`jsonl` (read in place), `jsonl.gz`, `json` or `json.gz` (candidates for conversion)."""
    name = path[:-3] if path.endswith(".gz") else path
    base = "json" if name.endswith(".json") else "jsonl"
    return base + (".gz" if path.endswith(".gz") else "")


def _text_chunks(path: str) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            yield decoder.decode(block)
        yield decoder.decode(b"", final=True)


class JsonElements:
    """The top-level value of a JSON file, element by element, in bounded memory (one element + one chunk).

    `shape` after the first call: 'array', 'value' (one JSON value: a single row) or 'lines' (more than one value:
    JSON lines). Raises ValueError(detail) for a broken file."""

    def __init__(self, path: str):
        self.chunks = _text_chunks(path)
        self.buf, self.i, self.eof, self.index, self.base = "", 0, False, 0, 0
        self.shape = ""

    def _more(self) -> bool:
        if self.eof:
            return False
        if self.i > CHUNK:
            self.buf, self.base, self.i = self.buf[self.i:], self.base + self.i, 0
        nxt = next(self.chunks, None)
        self.eof = nxt is None
        self.buf += nxt or ""
        return not self.eof

    def _skip_ws(self) -> str:
        while True:
            while self.i < len(self.buf) and self.buf[self.i] in " \t\n\r":
                self.i += 1
            if self.i < len(self.buf) or not self._more():
                return self.buf[self.i] if self.i < len(self.buf) else ""

    def _value(self) -> str:
        decoder = json.JSONDecoder()
        while True:
            try:
                _, end = decoder.raw_decode(self.buf, self.i)
                text, self.i = self.buf[self.i:end], end
                return text.replace("\n", " ").replace("\r", " ")
            except json.JSONDecodeError as exc:
                if len(self.buf) - self.i > MAX_ELEMENT_CHARS or not self._more():
                    raise ValueError(f"element {self.index}: {exc.msg} (character {self.base + exc.pos})") from None

    def __iter__(self) -> Iterator[str]:
        first = self._skip_ws()
        if first != "[":
            value = self._value() if first else ""
            self.shape = "lines" if self._skip_ws() else "value"
            if self.shape == "value" and value:
                yield value
            return
        self.shape, self.i = "array", self.i + 1
        if self._skip_ws() == "]":
            self.i += 1
        else:
            while True:
                yield self._value()
                self.index += 1
                sep = self._skip_ws()
                self.i += 1
                if sep == "]":
                    break
                if sep != ",":
                    raise ValueError(f"element {self.index}: expected ',' or ']', got {sep or 'the end of the file'!r}")
                self._skip_ws()
        if self._skip_ws():
            raise ValueError(f"data after the closing ']' (character {self.base + self.i})")


Converted = Tuple[str, int, Any, Optional[Tuple[str, str]]]


def convert(path: str, out: Path, new_scanner: Callable[[], Any]) -> Converted:
    """Write the JSONL copy of `path` into `out` if it needs one, feeding its bytes to a scanner (`new_scanner()`).
    Returns (read path, loc_base, the scanner, or None when `path` itself is read as JSONL, problem)."""
    kind = file_kind(path)
    scanner = new_scanner()
    if kind == "jsonl.gz":
        with atomic_writer(out) as fh, gzip.open(path, "rb") as src:
            for block in iter(lambda: src.read(CHUNK), b""):
                fh.write(block)
                scanner.feed(block)
        return str(out), 0, scanner, None
    elements = JsonElements(path)
    try:
        with atomic_writer(out) as fh:
            for text in elements:
                line = (text + "\n").encode("utf-8")
                fh.write(line)
                scanner.feed(line)
    except (ValueError, UnicodeDecodeError) as exc:
        reason = "invalid_utf8" if isinstance(exc, UnicodeDecodeError) else "invalid_json"
        return path, 0, None, (reason, f"whole file: {exc}")
    if elements.shape == "lines":  # JSON lines in a .json file: read as JSONL (decompressed when gzipped)
        out.unlink(missing_ok=True)
        if kind == "json.gz":
            return convert_gzip_lines(path, out, new_scanner)
        return path, 0, None, None
    if elements.shape == "value" and scanner.samples == 1 and not _is_object_line(out):
        return path, 0, None, ("not_an_object", "top level is not an array of rows")
    return str(out), -1, scanner, None


def convert_gzip_lines(path: str, out: Path, new_scanner: Callable[[], Any]) -> Converted:
    scanner = new_scanner()
    with atomic_writer(out) as fh, gzip.open(path, "rb") as src:
        for block in iter(lambda: src.read(CHUNK), b""):
            fh.write(block)
            scanner.feed(block)
    return str(out), 0, scanner, None


def _is_object_line(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(1) == b"{"
