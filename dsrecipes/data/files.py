"""Conversation files: which files a source names, and their rows parsed one by one.

Files are `.jsonl` (one row per line) or `.json` (an array of rows; a `.json` file holding JSON lines is read as
JSONL), optionally `.gz`. A row that cannot be parsed is returned with the reason (`RawRow.error`), never raised,
so the bad-row policy decides.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple, Union

from dsrecipes.data.badrows import BadReason, BadRow
from dsrecipes.fileio import open_maybe_gzip


@dataclass
class RawRow:
    """One row as read from a file: `value` is the parsed JSON, or `error` says why it could not be parsed."""

    path: str
    loc: Optional[int]  # 1-based line (JSONL) or 0-based array index (JSON); None: the whole file
    value: Any = None
    error: Optional[BadRow] = None
    raw_text: Optional[str] = None  # the undecodable/unparsable text, for the quarantine

    @property
    def default_id(self) -> str:
        return f"{os.path.basename(self.path)}:{self.loc}"


def expand_paths(patterns: List[str]) -> Tuple[List[str], List[str]]:
    """(files, patterns matching nothing): each glob sorted, duplicates removed, in pattern order."""
    files: List[str] = []
    missing: List[str] = []
    for pattern in patterns:
        matches = sorted(m for m in glob.glob(os.path.expanduser(pattern)) if os.path.isfile(m))
        if not matches:
            missing.append(pattern)
        files += [m for m in matches if m not in files]
    return files, missing


def _is_json_array_file(path: str) -> bool:
    name = path[:-3] if path.endswith(".gz") else path
    return name.endswith(".json")


def read_rows(path: str) -> Iterator[RawRow]:
    """Every row of one file, parsed, or with the reason it could not be (an empty file yields one bad RawRow)."""
    with open_maybe_gzip(path) as fh:
        if _is_json_array_file(path):
            data = fh.read()
            yield from _json_array_rows(path, data)
            return
        any_row = False
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            any_row = True
            yield _parse_line(path, lineno, line)
        if not any_row:
            yield RawRow(path, None, error=BadRow(BadReason.empty_file, "no rows"))


def read_row_items(path: str) -> Iterator[Union[Tuple[int, bytes], RawRow]]:
    """`read_rows` with the parsing left to the caller for JSONL lines: `(line number, bytes)` per non-blank line
    (parse with `parse_line`, e.g. in a worker process), RawRow for everything else (JSON arrays, empty files)."""
    if _is_json_array_file(path):
        yield from read_rows(path)
        return
    with open_maybe_gzip(path) as fh:
        any_row = False
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            any_row = True
            yield lineno, line
        if not any_row:
            yield RawRow(path, None, error=BadRow(BadReason.empty_file, "no rows"))


def parse_line(path: str, loc: int, line: bytes) -> RawRow:
    return _parse_line(path, loc, line)


def _parse_line(path: str, loc: int, line: bytes) -> RawRow:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRow(path, loc, error=BadRow(BadReason.invalid_utf8, str(exc)),
                      raw_text=line.decode("utf-8", errors="replace").rstrip("\r\n"))
    try:
        return RawRow(path, loc, value=json.loads(text))
    except json.JSONDecodeError as exc:
        return RawRow(path, loc, error=BadRow(BadReason.invalid_json, str(exc)), raw_text=text.rstrip("\r\n"))


def _json_array_rows(path: str, data: bytes) -> Iterator[RawRow]:
    if not data.strip():
        yield RawRow(path, None, error=BadRow(BadReason.empty_file, "no rows"))
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield RawRow(path, None, error=BadRow(BadReason.invalid_utf8, f"whole file: {exc}"))
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("{"):  # JSON lines in a .json file
            lines = data.splitlines()
            yield from (_parse_line(path, i, ln) for i, ln in enumerate(lines, start=1) if ln.strip())
            return
        yield RawRow(path, None, error=BadRow(BadReason.invalid_json, f"whole file: {exc}"), raw_text=text[:2000])
        return
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        yield RawRow(path, None, error=BadRow(BadReason.not_an_object, "top level is not an array of rows"))
        return
    if not value:
        yield RawRow(path, None, error=BadRow(BadReason.empty_file, "empty array"))
    for index, item in enumerate(value):
        yield RawRow(path, index, value=item)

