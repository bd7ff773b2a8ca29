"""Train/eval loaders: one builder per `DataKind`, all planned by `dsrecipes.data.plan`.

    build_train_loader(cfg, tokenizer, rank, world_size, run_dir) -> TrainLoader   (see strategies/base.py)
    build_eval_loader(cfg, tokenizer, rank, world_size, run_dir) -> EvalLoader | None

Guarantees, for every strategy, world size and `data.num_workers` (checked by `dsrecipes audit` and the tests):
1. within an epoch no sample is read twice across ranks and workers, and every sample is read except a remainder
   smaller than one global batch (world x micro_batch_size x grad_accum; presharded: per part, see presharded.py),
   which is the tail of the epoch's order and so changes between epochs when shuffling;
2. every rank runs exactly the same number of micro-batches, hence optimizer steps;
3. `state_dict()` resumes exactly, also under another world size or batch shape for map and iterable (elastic).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set

from dsrecipes.config.schema import BadRows, DataKind, TrainConfig
from dsrecipes.data.strategies.base import IGNORE_INDEX, Batch, Row, TrainLoader, collate_rows, placeholder_row
from dsrecipes.errors import DataError

__all__ = [
    "TrainLoader",
    "EvalLoader",
    "build_train_loader",
    "build_eval_loader",
    "make_collate",
    "make_row_encoder",
    "pad_token_id",
    "placeholder_row",
    "IGNORE_INDEX",
]

Builder = Callable[[TrainConfig, Any, int, int, str], TrainLoader]


def builders() -> Dict[DataKind, Builder]:
    """DataKind -> builder (imported here, not at module import, so `audit` does not pay for torch)."""
    from dsrecipes.data.strategies import iterable, map, presharded

    return {DataKind.map: map.build, DataKind.iterable: iterable.build, DataKind.presharded: presharded.build}


def build_train_loader(cfg: TrainConfig, tokenizer: Any, rank: int, world_size: int, run_dir: Any) -> TrainLoader:
    return builders()[cfg.data.kind](cfg, tokenizer, rank, world_size, str(run_dir))


# ---------------------------------------------------------------------------------------------------------------
# Rows and batches


def pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return tokenizer.eos_token_id if pad is None else pad


def make_collate(tokenizer: Any) -> Callable[[List[Row]], Batch]:
    from dsrecipes.data.collate import collate

    return collate_rows(collate, pad_token_id(tokenizer))


class RowEncoder:
    """Raw JSONL lines of a stream -> tokenized rows (one per sample, or packed rows), inside a loader worker.

    Bad rows follow `dataset.bad_rows`: `error` raises DataError naming file:line; `skip` drops the row (its slot in
    the micro-batch stays empty, so no other rank's sample moves) and counts it in `skipped`.
    """

    def __init__(self, cfg: TrainConfig, tokenizer: Any, paths: Sequence[str], sources: Sequence[Any],
                 holdout: Optional[Set[str]] = None):
        from dsrecipes.data.sharegpt import role_table
        from dsrecipes.data.tokenize import Encoder

        self.encoder = Encoder(tokenizer, cfg)
        self.paths = list(paths)
        self.sources = list(sources)
        self.tables = [role_table(s) for s in self.sources]
        self.policy = cfg.dataset.bad_rows
        self.packing = cfg.data.packing
        self.cutoff_len = cfg.data.cutoff_len
        self.holdout = holdout or set()  # validation ids (prepared split) that the stream must not train on
        self.skipped = 0
        self.held_out = 0
        self.dropped = 0  # samples whose trained tokens were all truncated away

    def conversation(self, item: Any) -> Any:
        from dsrecipes.data.sharegpt import BadReason, BadRow, RawRow, normalize_row, sample_id

        file_index, line_no, raw = item
        path, source = self.paths[file_index], self.sources[file_index]
        try:
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise BadRow(BadReason.invalid_utf8, str(exc)) from None
            except json.JSONDecodeError as exc:
                raise BadRow(BadReason.invalid_json, str(exc)) from None
            sid = sample_id(value, RawRow(path, line_no, value), source)
            if sid in self.holdout:
                self.held_out += 1
                return None
            return normalize_row(value, sid, source, self.tables[file_index])
        except BadRow as bad:
            self._bad(f"{path}:{line_no}", bad)
            return None

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


def _row(ids: List[str], input_ids: List[int], labels: List[int], position_ids: List[int]) -> Row:
    return {"ids": list(ids), "input_ids": list(input_ids), "labels": list(labels), "position_ids": list(position_ids)}


def make_row_encoder(cfg: TrainConfig, tokenizer: Any, paths: Sequence[str], sources: Sequence[Any],
                     holdout: Optional[Set[str]] = None) -> RowEncoder:
    return RowEncoder(cfg, tokenizer, paths, sources, holdout)


# ---------------------------------------------------------------------------------------------------------------
# Validation


class EvalLoader:
    """The validation rows of one rank: a contiguous share (sizes differ by at most one row), in order.

    Ranks can end one micro-batch apart; the runner stops evaluating when any rank runs out (ZeRO-3 forwards are
    collective), so nothing pads with duplicates.
    """

    def __init__(self, rows: Sequence[Row], rank: int, world_size: int, micro_batch_size: int,
                 collate_fn: Callable[[List[Row]], Batch]):
        n = len(rows)
        self.start, self.stop = rank * n // world_size, (rank + 1) * n // world_size
        self.rows = rows
        self.micro_batch_size = micro_batch_size
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return math.ceil((self.stop - self.start) / self.micro_batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for lo in range(self.start, self.stop, self.micro_batch_size):
            hi = min(lo + self.micro_batch_size, self.stop)
            getitems = getattr(self.rows, "__getitems__", None)
            rows = list(getitems(list(range(lo, hi)))) if getitems else [self.rows[i] for i in range(lo, hi)]
            yield self.collate_fn(rows)


def build_eval_loader(cfg: TrainConfig, tokenizer: Any, rank: int, world_size: int, run_dir: Any) -> Optional[EvalLoader]:
    """The prepared validation split (`dataset.val_size`), or None when there is none.

    presharded data has none; iterable data has one only when the launcher ran `prepare` (then the stream holds
    those samples out, see `validation_ids`)."""
    val = prepared_val(cfg, run_dir)
    if val is None or len(val) == 0:
        return None
    return EvalLoader(val, rank, world_size, cfg.trainer.micro_batch_size, make_collate(tokenizer))


def prepared_val(cfg: TrainConfig, run_dir: Any) -> Any:
    from pathlib import Path

    from dsrecipes.data.prepare import STATS_FILE, load_prepared

    if cfg.data.kind is DataKind.presharded or cfg.dataset.val_size == 0:
        return None
    if cfg.data.kind is DataKind.iterable and not (Path(run_dir) / STATS_FILE).is_file():
        return None
    return load_prepared(cfg, str(run_dir)).val


def validation_ids(cfg: TrainConfig, run_dir: Any) -> Set[str]:
    """Sample ids of the prepared validation split (a sample id is a row's id, or file:line)."""
    val = prepared_val(cfg, run_dir)
    if val is None:
        return set()
    return {i for ids in val["ids"] for i in ids}
