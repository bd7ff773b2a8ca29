"""Rows of a stream: raw JSONL lines -> tokenized rows inside a loader worker, and the collate function."""

from __future__ import annotations

import json
from typing import Any, Callable, List, Sequence

from dsrecipes.config.schema import BadRows, TrainConfig
from dsrecipes.data.strategies.base import Batch, Row, collate_rows
from dsrecipes.errors import DataError


def pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return tokenizer.eos_token_id if pad is None else pad


def make_collate(tokenizer: Any) -> Callable[[List[Row]], Batch]:
    from dsrecipes.data.collate import collate

    return collate_rows(collate, pad_token_id(tokenizer))


class RowEncoder:
    """Raw JSONL lines of a stream -> tokenized rows (one per sample, or packed rows), inside a loader worker.

    Items are (file index, location, raw line[, copy]); `paths` name the files as the user gave them (a converted
    JSON array keeps its own name; the location is then the element). Bad rows follow `dataset.bad_rows`: `error`
    raises DataError naming file:location; `skip` drops the row (its slot in the micro-batch stays empty, so no
    other rank's sample moves) and counts it in `skipped`.
    """

    def __init__(self, cfg: TrainConfig, tokenizer: Any, paths: Sequence[str], sources: Sequence[Any]):
        from dsrecipes.data.sharegpt import role_table
        from dsrecipes.data.tokenize import Encoder

        self.encoder = Encoder(tokenizer, cfg)
        self.paths = list(paths)
        self.sources = list(sources)
        self.tables = [role_table(s) for s in self.sources]
        self.policy = cfg.dataset.bad_rows
        self.packing = cfg.data.packing
        self.cutoff_len = cfg.data.cutoff_len
        self.skipped = 0
        self.dropped = 0  # samples whose trained tokens were all truncated away

    def conversation(self, item: Any) -> Any:
        from dsrecipes.data.badrows import BadRow

        file_index, loc, raw = item[:3]
        try:
            conv = parse_item(raw, self.paths[file_index], loc, self.sources[file_index], self.tables[file_index])
        except BadRow as bad:
            self._bad(f"{self.paths[file_index]}:{loc}", bad)
            return None
        if len(item) > 3 and item[3]:
            conv.id = f"{conv.id}@{item[3]}"  # a repeat made by a mixing weight > 1 is a sample of its own
        return conv

    def _bad(self, where: str, bad: Any) -> None:
        if self.policy is BadRows.error:
            raise DataError(f"{where}: {bad}; set dataset.bad_rows=skip to drop such rows")
        self.skipped += 1

    def __call__(self, items: Sequence[Any]) -> List[Row]:
        convs = [c for c in (self.conversation(item) for item in items) if c is not None]
        errors: List[Any] = []
        encoded = self.encoder.encode_batch(convs, errors) if convs else []
        for conv, bad in errors:
            self._bad(f"sample {conv.id}", bad)
        examples = [e for e in encoded if e is not None]
        self.dropped += len(convs) - len(examples) - len(errors)
        if self.packing:
            from dsrecipes.data.tokenize import pack

            return [_row(p.ids, p.input_ids, p.labels, p.position_ids) for p in pack(examples, self.cutoff_len)]
        return [_row([e.id], e.input_ids, e.labels, list(range(len(e.input_ids)))) for e in examples]


def parse_item(raw: bytes, path: str, loc: int, source: Any, table: Any) -> Any:
    """One raw line -> Conversation (with its sample id), or BadRow: the checks every stream row goes through."""
    from dsrecipes.data.badrows import BadReason, BadRow
    from dsrecipes.data.files import RawRow
    from dsrecipes.data.sharegpt import normalize_row, sample_id

    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BadRow(BadReason.invalid_utf8, str(exc)) from None
    except json.JSONDecodeError as exc:
        raise BadRow(BadReason.invalid_json, str(exc)) from None
    conv = normalize_row(value, sample_id(value, RawRow(path, loc, value), source), source, table)
    conv.path, conv.loc = path, loc
    return conv


def _row(ids: List[str], input_ids: List[int], labels: List[int], position_ids: List[int]) -> Row:
    return {"ids": list(ids), "input_ids": list(input_ids), "labels": list(labels), "position_ids": list(position_ids)}


