"""Preference pairs of a stream or a presharded part (`objective=dpo`): raw lines -> pair rows inside a loader worker.

The counterpart of `rows.RowEncoder` for pairs, with the same items, the same bad-row policy and the same checks as
every other reader of pairs (`preference.parse_pair_item`, then `PairEncoder.encode_batch`: the checks of map
preparation and of the stream pre-scan). A pair is one sample: one line, one id (`<id>@<copy>` for a repeat made by
a mixing weight > 1), one row holding the prompt once and both answers (`preference_encode.py`), so the block order,
the micro-batch slots, equal steps, resume and the ledgers count pairs exactly as they count conversations.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from dsrecipes.data.render.preference_encode import PairEncoder
from dsrecipes.data.sources.badrows import BadRow, error_message
from dsrecipes.data.sources.files import where
from dsrecipes.data.sources.preference import Pair, parse_pair_item
from dsrecipes.data.sources.sharegpt import role_table
from dsrecipes.data.strategies.base import Row
from dsrecipes.errors import DataError
from dsrecipes.schema import BadRows, TrainConfig


class PairRowEncoder:
    """Items (file index, location, raw line[, copy]) -> pair rows; `skipped` counts bad rows under `skip` (their
    slot in the micro-batch stays empty, so no other rank's pair moves)."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, paths: Sequence[str], sources: Sequence[Any],
                 element_files: Optional[Sequence[bool]] = None):
        self.encoder = PairEncoder(tokenizer, cfg)
        self.paths = list(paths)
        self.sources = list(sources)
        self.tables = [role_table(s) for s in self.sources]
        self.policy = cfg.dataset.bad_rows
        self.max_row_bytes = cfg.dataset.max_row_bytes
        self.element_files = list(element_files) if element_files is not None else [False] * len(self.paths)
        self.skipped = 0

    def pair(self, item: Any) -> Optional[Pair]:
        file_index, loc, raw = item[:3]
        path, element = self.paths[file_index], self.element_files[file_index]
        try:
            pair = parse_pair_item(raw, path, loc, self.sources[file_index], self.tables[file_index],
                                   limit=self.max_row_bytes, element=element)
        except BadRow as bad:
            self._bad(where(path, None if element else loc, loc if element else None), bad)
            return None
        if len(item) > 3 and item[3]:
            pair.prompt.id = f"{pair.prompt.id}@{item[3]}"  # a repeat made by a mixing weight > 1
        return pair

    def _bad(self, location: str, bad: BadRow) -> None:
        if self.policy is BadRows.error:
            raise DataError(error_message(location, bad))
        self.skipped += 1

    def __call__(self, items: Sequence[Any]) -> List[Row]:
        pairs = [p for p in (self.pair(item) for item in items) if p is not None]
        rows: List[Row] = []
        for pair, got in zip(pairs, self.encoder.encode_batch(pairs) if pairs else []):
            if isinstance(got, BadRow):
                p = pair.prompt
                self._bad(where(p.path, p.loc, p.element), got)
                continue
            got.pop("truncated", None)  # a statistic of preparation, not a column of the batch
            rows.append(got)
        return rows
