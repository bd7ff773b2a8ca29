"""Top-level JSON values of a byte stream, found without parsing them: `.json` files read with bounded memory.

`json.loads` of a whole `.json` file holds the file's text and every row at once, and one broken row takes the
whole file with it. This scanner walks the bytes (only quotes, backslashes and brackets are looked at, with C-speed
regexes between them) and hands out one top-level value at a time: its bytes (None when it is longer than the row
limit: those bytes are skipped, never kept), its 0-based index, the line it starts on and its bracket depth. Each
value is then parsed on its own (`files.parse_row`), so a bad element is one bad row. What cannot be split into
values (a missing comma, an unclosed bracket or string, mismatched brackets, text after the array) raises
`JsonStructureError` with the line and the number of values read before it.
"""

from __future__ import annotations

import re
from typing import IO, Callable, Iterator, NamedTuple, Optional

CHUNK = 1 << 20
BOM = b"\xef\xbb\xbf"
_WS = re.compile(rb"[ \t\r\n]*")
_STRUCT = re.compile(rb'[\[\]{}"]')
_STRING_BODY = re.compile(rb'(?:[^"\\]++|\\.)*+', re.S)  # up to the closing quote (or a backslash at the end)
_SCALAR_END = re.compile(rb"[,\]}\[{\" \t\r\n]")
_CLOSES = {ord("]"): ord("["), ord("}"): ord("{")}


class Value(NamedTuple):
    element: Optional[int]  # 0-based index in the top-level array; None for values of a JSON-lines stream
    line: int  # 1-based line where the value starts
    data: Optional[bytes]  # the value's bytes; None when longer than the limit
    depth: int  # deepest bracket nesting inside the value (0 for a string or number)


class _Unclosed(Exception):
    """The file ended inside a value (kept apart from EOFError, which a truncated gzip stream raises)."""


class JsonStructureError(Exception):
    def __init__(self, line: int, values_read: int, message: str):
        super().__init__(message)
        self.line, self.values_read, self.message = line, values_read, message


class _Window:
    """A forward-only window over a binary file: `buf[pos:]` is unread; bytes before `keep` are dropped on refill."""

    def __init__(self, fh: IO[bytes], limit: int, sink: Optional[Callable[[bytes], None]] = None):
        self.fh, self.limit, self.sink = fh, limit, sink
        self.buf, self.pos, self.eof = b"", 0, False
        self.line, self.counted = 1, 0  # `line` is the line at position `counted`
        self.start: Optional[int] = None  # where the value being captured starts
        self.over = False  # the value being captured is longer than `limit`

    def more(self) -> bool:
        """Read the next chunk (keeping a captured value's bytes); False at the end of the file."""
        if self.eof:
            return False
        if self.sink is not None and self.start is not None:  # hand the value's bytes on instead of keeping them
            self.sink(self.buf[self.start:self.pos])
            self.start = self.pos
        keep = self.pos if self.start is None else self.start
        self.line_at(keep)
        data = self.fh.read(CHUNK)
        self.buf = self.buf[keep:] + data
        self.pos -= keep
        self.counted -= keep
        if self.start is not None:
            self.start -= keep
            if self.sink is None and self.pos - self.start > self.limit:  # too long: stop keeping it, scan on to its end
                self.start, self.over = None, True
        self.eof = not data
        return bool(data)

    def line_at(self, p: int) -> int:
        self.line += self.buf.count(b"\n", self.counted, p)
        self.counted = p
        return self.line

    def skip_ws(self) -> bool:
        """Move past whitespace; False at the end of the file."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return True
            if not self.more():
                return False

    def string(self) -> None:
        self.pos += 1
        while True:
            self.pos = _STRING_BODY.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) and self.buf[self.pos] == 0x22:
                self.pos += 1
                return
            if not self.more():  # end of the buffer, or a backslash that is its last byte
                raise _Unclosed("a string is not closed")

    def nested(self) -> int:
        stack = bytearray([self.buf[self.pos]])
        deepest = 1
        self.pos += 1
        while stack:
            m = _STRUCT.search(self.buf, self.pos)
            if m is None:
                self.pos = len(self.buf)
                if not self.more():
                    raise _Unclosed(f"{len(stack)} bracket(s) not closed")
                continue
            self.pos = m.start()
            c = self.buf[self.pos]
            if c == 0x22:
                self.string()
                continue
            self.pos += 1
            if c in _CLOSES:
                opener = stack.pop()
                if opener != _CLOSES[c]:
                    raise ValueError(f"{chr(c)!r} closes {chr(opener)!r}")
            else:
                stack.append(c)
                deepest = max(deepest, len(stack))
        return deepest

    def scalar(self) -> None:
        while True:
            m = _SCALAR_END.search(self.buf, self.pos)
            if m is not None:
                self.pos = m.start()
                return
            self.pos = len(self.buf)
            if not self.more():
                return


def values(fh: IO[bytes], limit: int, array: Optional[bool] = None,
           sink: Optional[Callable[[bytes], None]] = None) -> Iterator[Value]:
    """Top-level values of `fh`: the elements of a JSON array when the first byte (after whitespace and a UTF-8 byte
    order mark) is '[' (or `array` says so), else values separated by whitespace (JSON lines, or one pretty-printed
    object). With `sink`, each value's bytes are handed to it piece by piece (any size, never kept; `data` is None).
    Raises JsonStructureError where the bytes cannot be split into values."""
    w = _Window(fh, limit, sink)
    if not w.skip_ws():
        return
    if w.pos == 0 and w.buf.startswith(BOM):
        w.pos = len(BOM)
        if not w.skip_ws():
            return
    index = 0
    if array is None:
        array = w.buf[w.pos] == 0x5B
    if array:
        w.pos += 1
        _expect_value_or_close(w, index, first=True)
    while True:
        if array and w.buf[w.pos] == 0x5D:  # ']'
            w.pos += 1
            if w.skip_ws():
                raise JsonStructureError(w.line_at(w.pos), index, "text after the end of the array")
            return
        yield _value(w, index, array)
        index += 1
        if array:
            _after_element(w, index)
        elif not w.skip_ws():
            return


def _value(w: _Window, index: int, array: bool) -> Value:
    line = w.line_at(w.pos)
    w.start, w.over = w.pos, False
    c = w.buf[w.pos]
    try:
        if c == 0x22:
            w.string()
            depth = 0
        elif c in (0x5B, 0x7B):
            depth = w.nested()
        elif c in (0x5D, 0x7D, 0x2C, 0x3A):  # ] } , : cannot start a value
            raise ValueError(f"unexpected {chr(c)!r}")
        else:
            w.scalar()
            depth = 0
    except _Unclosed as exc:
        raise JsonStructureError(line, index, f"value {index} starting at line {line} is cut off at the end of the "
                                 f"file ({exc})") from None
    except ValueError as exc:
        raise JsonStructureError(w.line_at(w.pos), index, f"{exc} in value {index} (starting at line {line})") from None
    data = None
    if w.sink is not None:
        w.sink(w.buf[w.start: w.pos])
    elif w.start is not None and w.pos - w.start <= w.limit:
        data = w.buf[w.start: w.pos]
    w.start = None
    return Value(index if array else None, line, data, depth)


def _expect_value_or_close(w: _Window, index: int, first: bool) -> None:
    if not w.skip_ws():
        raise JsonStructureError(w.line_at(w.pos), index, "the array is not closed (no ']' before the end of the file)")
    if not first and w.buf[w.pos] == 0x5D:
        raise JsonStructureError(w.line_at(w.pos), index, "a trailing ',' before ']'")


def _after_element(w: _Window, index: int) -> None:
    if not w.skip_ws():
        raise JsonStructureError(w.line_at(w.pos), index, "the array is not closed (no ']' before the end of the file)")
    c = w.buf[w.pos]
    if c == 0x2C:  # ','
        w.pos += 1
        _expect_value_or_close(w, index, first=False)
    elif c != 0x5D:
        raise JsonStructureError(w.line_at(w.pos), index,
                                 f"expected ',' or ']' after element {index - 1}, found {chr(c)!r}")
