"""Rows of a stream or a presharded part that are one sample around a prompt (`rows=pair`, `rows=prompt`:
`samples.SampleKind`): raw lines -> the kind's rows inside a loader worker.

The counterpart of `rows.RowEncoder` for such rows, with the same items, the same bad-row policy and the same checks
as every other reader of the kind (its `parse_item`, then its encoder's `encode_batch`: the checks of map preparation
and of the stream pre-scan). A sample is one line and one id (`<id>@<copy>` for a repeat made by a mixing weight
> 1): a pair holds the prompt once and both answers (`preference_encode.py`), a prompt its ids and reference, so the
block order, the micro-batch slots, equal steps, resume and the ledgers count them exactly as they count
conversations. One implementation for every such kind, parameterised by the kind and its encoder (data/rowkinds.py:
the kind's `loader`).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.files import where
from dsrecipes.data.sources.samples import SampleKind
from dsrecipes.data.strategies.base import Row
from dsrecipes.data.strategies.item_rows import ItemRows


class SampleRowEncoder(ItemRows):
    """Items (file index, location, raw line[, copy]) -> rows of `kind`; `skipped` counts bad rows under `skip`
    (their slot in the micro-batch stays empty, so no other rank's sample moves)."""

    def __init__(self, kind: SampleKind, encoder: Callable[..., Any], cfg: TrainConfig, tokenizer: Any,
                 paths: Sequence[str], sources: Sequence[Any], element_files: Optional[Sequence[bool]] = None):
        super().__init__(cfg, paths, sources, element_files)
        self.kind = kind
        self.encoder = encoder(tokenizer, cfg)

    def sample(self, item: Any) -> Optional[Any]:
        return self.parsed(item, self.kind.parse_item, lambda sample: sample.prompt)

    def __call__(self, items: Sequence[Any]) -> List[Row]:
        samples = [s for s in (self.sample(item) for item in items) if s is not None]
        rows: List[Row] = []
        for sample, got in zip(samples, self.encoder.encode_batch(samples) if samples else []):
            if isinstance(got, BadRow):
                p = sample.prompt
                self._bad(where(p.path, p.loc, p.element), got)
                continue
            got.pop("truncated", None)  # a statistic of preparation, not a column of the batch
            rows.append(got)
        return rows
