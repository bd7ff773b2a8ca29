"""The row pre-scan of a stream one file at a time: fed in the pass that indexes the file, kept by content.

`data.prescan` checks every row with the checks of training before any rank starts. Reading the corpus again for
that (after the pass that indexes it) doubles what the launching process reads, and reading it on every launch
makes a warm start cost a full pass. So the scan of a file is a `FileScan` - the file's sample count, its bad rows
(sample number, line, reason, quarantine text) and the samples that lost trailing turns - independent of caps and
of the bad-row policy, which `scan.py` applies afterwards:
  - `RowTap` is fed the file's bytes in order by the indexing pass (stream/files.py: the content-hash pass of a
    local JSONL file, the streaming pass of an object), cuts them into lines as `BlockSource.samples` does, and
    checks each sample row (`sharegpt.parse_item`, then `tokenize.Encoder` in batches);
  - a finished scan is saved under `<cache>/stream/<content key>-scan-<key>.json` (the key: the file's source
    settings, template, tokenization settings and the tokenizer), so a warm launch reads no content at all;
  - a file whose index came from the cache but whose scan did not (a new tokenizer) is read once, by blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from dsrecipes.core.fileio import atomic_write_json, read_json_file
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.files import element_line
from dsrecipes.data.sources.sharegpt import conversation_dict, parse_item, role_table

SCAN_VERSION = 6  # 2: a row of another kind keeps its advice (the 7th entry of `bad`); 3: prompt rows get theirs;
# 4: a pair row whose prompt holds answers is refused under SFT (preference_row); 5: TRL's implicit-prompt pairs read;
# 6: prompt rows record which have no reference answer (`no_reference`)
BATCH = 256  # conversations per tokenization call


@dataclass
class FileScan:
    count: int = 0  # sample rows checked
    bad: List[list] = field(default_factory=list)  # [sample, line, reason, detail, raw text, element(, advice)]
    dropped: List[int] = field(default_factory=list)  # samples that lost trailing non-assistant turns
    no_reference: Optional[List[int]] = None  # prompt rows read without a reference answer (other kinds: None)

    def bad_rows(self) -> List[tuple]:
        """(sample, line, BadRow, raw, element) in sample order."""
        return [(s, line, BadRow(BadReason(r), d, *advice), raw, el)
                for s, line, r, d, raw, el, *advice in sorted(self.bad, key=_first)]


def _first(entry: list) -> int:
    return entry[0]


class RowChecker:
    """The checks of training for the sample rows of one file, fed in file order: `row(loc, raw)`."""

    def __init__(self, name: str, source: Any, element: bool, limit: int, encoder: Any):
        self.name, self.source, self.element, self.limit, self.encoder = name, source, element, limit, encoder
        self.table = role_table(source)
        self.scan = FileScan()
        self._batch: List[tuple] = []

    def row(self, loc: int, raw: Optional[bytes]) -> None:
        """One sample row: read (`parse`; a BadRow is recorded with the raw text), then checked in batches of BATCH
        (`_encode`). The same for every row kind: the kinds differ in `parse`, `dropped` and `_encode` alone."""
        sample = self.scan.count
        self.scan.count += 1
        try:
            item = self.parse(raw, loc)
        except BadRow as bad:
            text = None if raw is None else raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.scan.bad.append([sample, self.line(loc), bad.reason.value, bad.detail, text,
                                  loc if self.element else None, bad.advice])
            return
        if self.dropped(item):
            self.scan.dropped.append(sample)
        self.read(sample, item)
        self._batch.append((sample, item))
        if len(self._batch) == BATCH:
            self._encode()

    def parse(self, raw: Optional[bytes], loc: int) -> Any:
        return parse_item(raw, self.name, loc, self.source, self.table, limit=self.limit, element=self.element)

    def dropped(self, conv: Any) -> bool:
        """Whether the row lost trailing non-assistant turns."""
        return conv.dropped_turns > 0

    def read(self, sample: int, item: Any) -> None:
        """What a kind records of a row that was read (before its batch is checked): nothing for conversations."""

    def line(self, loc: int) -> Optional[int]:
        return element_line(self.name, loc) if self.element else loc

    def _encode(self) -> None:
        if not self._batch:
            return
        errors: List[Any] = []
        convs = [c for _, c in self._batch]
        self.encoder.encode_batch(convs, errors)
        bad = {id(conv): b for conv, b in errors}
        for sample, conv in self._batch:
            if id(conv) in bad:
                line = conv.loc if conv.element is None or conv.loc is not None else element_line(conv.path,
                                                                                                   conv.element)
                b = bad[id(conv)]
                self.scan.bad.append([sample, line, b.reason.value, b.detail, conversation_dict(conv), conv.element])
        self._batch = []

    def finish(self) -> FileScan:
        self._encode()
        return self.scan


class RowTap:
    """Bytes of a JSONL file in order -> `checker.row(line, raw)` for every non-blank line (raw None: longer than
    `limit`, never held whole), exactly the sample lines `BlockSource.samples` returns."""

    def __init__(self, checker: RowChecker, limit: int):
        self.checker, self.limit = checker, limit
        self.line_no = 0
        self.fed = 0  # bytes fed: the scan counts only when the whole file was fed
        self._parts: List[bytes] = []
        self._size = 0
        self._over = False

    def feed(self, chunk: bytes) -> None:
        self.fed += len(chunk)
        pieces = chunk.split(b"\n")
        for k, piece in enumerate(pieces):
            self._size += len(piece)
            self._over = self._over or self._size > self.limit
            if not self._over:
                self._parts.append(piece)
            if k < len(pieces) - 1:
                self._line()

    def _line(self) -> None:
        self.line_no += 1
        if self._over:
            self.checker.row(self.line_no, None)  # blank lines are never over the limit's worth of spaces here
        else:
            raw = b"".join(self._parts)
            if raw.strip():
                self.checker.row(self.line_no, raw)
        self._parts, self._size, self._over = [], 0, False

    def finish(self) -> FileScan:
        if self._parts or self._over:
            if self._over or b"".join(self._parts).strip():
                self._line()
        return self.checker.finish()


# ---------------------------------------------------------------------------------------------------------------
# Kept by content


def scan_path(root: Path, digest: str, key: str) -> Path:
    return root / f"{digest}-scan-{key}-v{SCAN_VERSION}.json"


def load_scan(path: Path) -> Optional[FileScan]:
    try:
        return FileScan(**read_json_file(path, "nested too deeply"))  # a FIFO, too large, too deep: scanned again
    except (OSError, ValueError, TypeError):
        return None


def save_scan(path: Path, scan: FileScan) -> None:
    try:
        atomic_write_json(path, asdict(scan), indent=None)
    except OSError:
        pass  # a read-only cache only costs scanning again next time


class Taps:
    """The RowTaps of one indexing pass, by file name: `factory(name, source)` gives the feed of a JSONL file read
    in place (the indexing pass calls it only for those)."""

    def __init__(self, make: Callable[[str, Any], Optional[RowTap]]):
        self.make = make
        self.taps: Dict[str, RowTap] = {}

    def factory(self, name: str, source: Any) -> Optional[Callable[[bytes], None]]:
        tap = self.make(name, source)
        if tap is None:
            return None
        self.taps[name] = tap
        return tap.feed

    def result(self, name: str, size: int) -> Optional[FileScan]:
        """The scan of `name` if its `size` bytes were all fed in the indexing pass."""
        tap = self.taps.pop(name, None)
        return None if tap is None or tap.fed != size else tap.finish()
