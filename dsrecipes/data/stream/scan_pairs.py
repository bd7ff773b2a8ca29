"""The row pre-scan of a stream of preference pairs (`objective=dpo data=iterable`): `scan_files.RowChecker`'s part
for pairs, with the checks of the loader workers (`preference.parse_pair_item`, then `PairEncoder.encode_batch`:
reading, rendering, tokenizing, truncation). It records a `FileScan` exactly like the conversation checker, so the
scan cache, caps, bad-row policy and quarantine of `scan.py` apply to pairs unchanged.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.files import element_line
from dsrecipes.data.sources.preference import Pair, pair_row, parse_pair_item
from dsrecipes.data.sources.sharegpt import role_table
from dsrecipes.data.stream.scan_files import BATCH, FileScan


class PairChecker:
    """The checks of training for the pair rows of one file, fed in file order: `row(loc, raw)`."""

    def __init__(self, name: str, source: Any, element: bool, limit: int, encoder: Any):
        self.name, self.source, self.element, self.limit, self.encoder = name, source, element, limit, encoder
        self.table = role_table(source)
        self.scan = FileScan()
        self._batch: List[Tuple[int, Pair]] = []

    def _line(self, loc: int) -> Optional[int]:
        return element_line(self.name, loc) if self.element else loc

    def row(self, loc: int, raw: Optional[bytes]) -> None:
        sample = self.scan.count
        self.scan.count += 1
        try:
            pair = parse_pair_item(raw, self.name, loc, self.source, self.table, limit=self.limit,
                                   element=self.element)
        except BadRow as bad:
            text = None if raw is None else raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self.scan.bad.append([sample, self._line(loc), bad.reason.value, bad.detail, text,
                                  loc if self.element else None])
            return
        self._batch.append((sample, pair))
        if len(self._batch) == BATCH:
            self._encode()

    def _encode(self) -> None:
        if not self._batch:
            return
        got = self.encoder.encode_batch([p for _, p in self._batch])
        for (sample, pair), result in zip(self._batch, got):
            if isinstance(result, BadRow):
                loc = pair.prompt.loc if pair.prompt.loc is not None else pair.prompt.element
                self.scan.bad.append([sample, self._line(loc), result.reason.value, result.detail, pair_row(pair),
                                      pair.prompt.element])
        self._batch = []

    def finish(self) -> FileScan:
        self._encode()
        return self.scan
