"""The row pre-scan of a stream of preference pairs (`rows=pair data=iterable`): `scan_files.RowChecker`'s part
for pairs, with the checks of the loader workers (`preference.parse_pair_item`, then `PairEncoder.encode_batch`:
reading, rendering, tokenizing, truncation). It records a `FileScan` exactly like the conversation checker, so the
scan cache, caps, bad-row policy and quarantine of `scan.py` apply to pairs unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.preference import Pair, pair_row, parse_pair_item
from dsrecipes.data.stream.scan_files import RowChecker


class PairChecker(RowChecker):
    """The checks of training for the pair rows of one file, fed in file order: `row(loc, raw)` (scan_files.py)."""

    def parse(self, raw: Optional[bytes], loc: int) -> Pair:
        return parse_pair_item(raw, self.name, loc, self.source, self.table, limit=self.limit, element=self.element)

    def dropped(self, pair: Any) -> bool:
        return False  # a pair's prompt ends with a user turn: nothing trailing to drop

    def _encode(self) -> None:
        if not self._batch:
            return
        got = self.encoder.encode_batch([p for _, p in self._batch])
        for (sample, pair), result in zip(self._batch, got):
            if isinstance(result, BadRow):
                loc = pair.prompt.loc if pair.prompt.loc is not None else pair.prompt.element
                self.scan.bad.append([sample, self.line(loc), result.reason.value, result.detail, pair_row(pair),
                                      pair.prompt.element])
        self._batch = []
