"""Preference pairs of a stream or a presharded part (`rows=pair`): raw lines -> pair rows inside a loader worker.

The counterpart of `rows.RowEncoder` for pairs, with the same items, the same bad-row policy and the same checks as
every other reader of pairs (`preference.parse_pair_item`, then `PairEncoder.encode_batch`: the checks of map
preparation and of the stream pre-scan). A pair is one sample: one line, one id (`<id>@<copy>` for a repeat made by
a mixing weight > 1), one row holding the prompt once and both answers (`preference_encode.py`), so the block order,
the micro-batch slots, equal steps, resume and the ledgers count pairs exactly as they count conversations.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.render.preference_encode import PairEncoder
from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.files import where
from dsrecipes.data.sources.preference import Pair, parse_pair_item
from dsrecipes.data.strategies.base import Row
from dsrecipes.data.strategies.item_rows import ItemRows


class PairRowEncoder(ItemRows):
    """Items (file index, location, raw line[, copy]) -> pair rows; `skipped` counts bad rows under `skip` (their
    slot in the micro-batch stays empty, so no other rank's pair moves)."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, paths: Sequence[str], sources: Sequence[Any],
                 element_files: Optional[Sequence[bool]] = None):
        super().__init__(cfg, paths, sources, element_files)
        self.encoder = PairEncoder(tokenizer, cfg)

    def pair(self, item: Any) -> Optional[Pair]:
        return self.parsed(item, parse_pair_item, lambda pair: pair.prompt)

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
