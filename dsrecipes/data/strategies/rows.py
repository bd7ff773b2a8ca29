"""Rows of a stream: raw JSONL lines -> tokenized rows inside a loader worker, and the collate function."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.render.packing import pack
from dsrecipes.data.render.tokenize import Encoder
from dsrecipes.data.rowkinds import ROW_KINDS
from dsrecipes.data.sources.files import where
from dsrecipes.data.sources.sharegpt import parse_item
from dsrecipes.data.strategies.base import Batch, Row
from dsrecipes.data.strategies.item_rows import ItemRows
from dsrecipes.objectives import build_objective


def row_encoder(cfg: TrainConfig, tokenizer: Any, paths: Sequence[str], sources: Sequence[Any],
                element_files: Optional[Sequence[bool]] = None) -> Any:
    """The rows of the run's objective (`objective.rows`, rowkinds.py: the kind's `loader`) from raw lines:
    conversations (`RowEncoder`), or preference pairs and prompts (`sample_rows.SampleRowEncoder` of the kind: a pair,
    a prompt is one sample)."""
    return ROW_KINDS[cfg.objective.rows].loader_factory()(cfg, tokenizer, paths, sources, element_files)


def make_collate(cfg: TrainConfig, tokenizer: Any) -> Callable[[List[Row]], Batch]:
    """The objective's collate (objectives/base.py): it owns the batch layout, empty micro-batches included."""
    return build_objective(cfg, tokenizer).collate


class RowEncoder(ItemRows):
    """Raw JSONL lines of a stream -> tokenized rows (one per sample, or packed rows), inside a loader worker.

    Items are (file index, location, raw line[, copy]); `paths` name the files as the user gave them (a converted
    JSON array keeps its own name; the location is then the element: `element_files`). Bad rows follow
    `dataset.bad_rows`: `error` raises DataError naming `file:line` (or `file: element N (line L)`); `skip` drops
    the row (its slot in the micro-batch stays empty, so no other rank's sample moves) and counts it in `skipped`.
    The checks are those of every other reader (`sharegpt.parse_item`: `files.parse_row`, `conversation_of`,
    then `Encoder.encode_batch`), so the pre-scan has met every row that could fail here.
    """

    def __init__(self, cfg: TrainConfig, tokenizer: Any, paths: Sequence[str], sources: Sequence[Any],
                 element_files: Optional[Sequence[bool]] = None):
        super().__init__(cfg, paths, sources, element_files)
        self.encoder = Encoder(tokenizer, cfg)
        self.packing = cfg.data.packing
        self.cutoff_len = cfg.data.cutoff_len
        self.dropped = 0  # samples whose trained tokens were all truncated away

    def conversation(self, item: Any) -> Any:
        return self.parsed(item, parse_item, lambda conv: conv)

    def __call__(self, items: Sequence[Any]) -> List[Row]:
        convs = [c for c in (self.conversation(item) for item in items) if c is not None]
        errors: List[Any] = []
        encoded = self.encoder.encode_batch(convs, errors) if convs else []
        for conv, bad in errors:
            self._bad(where(conv.path, conv.loc, conv.element), bad)
        examples = [e for e in encoded if e is not None]
        self.dropped += len(convs) - len(examples) - len(errors)
        if self.packing:
            return [_row(p.ids, p.input_ids, p.labels, p.position_ids) for p in pack(examples, self.cutoff_len)]
        return [_row([e.id], e.input_ids, e.labels, list(range(len(e.input_ids)))) for e in examples]


def _row(ids: List[str], input_ids: List[int], labels: List[int], position_ids: List[int]) -> Row:
    return {"ids": list(ids), "input_ids": list(input_ids), "labels": list(labels), "position_ids": list(position_ids)}

