"""Train/eval loaders: one builder per `DataKind`, all planned by `dsrecipes.data.plan`.

    build_train_loader(cfg, tokenizer, rank, world_size, run_dir) -> TrainLoader   (see strategies/base.py)
    build_eval_loader(cfg, tokenizer, rank, world_size, run_dir) -> EvalLoader | None   (strategies/eval.py)

Guarantees, for every strategy, world size and `data.num_workers` (checked by `dsrecipes audit` and the tests):
1. within an epoch no sample is read twice across ranks and workers, and every sample is read except a remainder
   smaller than one global batch (world x micro_batch_size x grad_accum; presharded: per part, see presharded.py),
   which is the tail of the epoch's order and so changes between epochs when shuffling;
2. every rank runs exactly the same number of micro-batches, hence optimizer steps;
3. `state_dict()` resumes exactly, also under another world size or batch shape for map and iterable (elastic).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from dsrecipes.config.schema import DataKind, TrainConfig
from dsrecipes.data.strategies.base import TrainLoader
from dsrecipes.data.strategies.eval import EvalLoader, prepared_val
from dsrecipes.data.strategies.rows import make_collate

Builder = Callable[[TrainConfig, Any, int, int, str], TrainLoader]


def builders() -> Dict[DataKind, Builder]:
    """DataKind -> builder (imported here, not at module import, so `audit` does not pay for torch)."""
    from dsrecipes.data.strategies import iterable, map, presharded

    return {DataKind.map: map.build, DataKind.iterable: iterable.build, DataKind.presharded: presharded.build}


def build_train_loader(cfg: TrainConfig, tokenizer: Any, rank: int, world_size: int, run_dir: Any) -> TrainLoader:
    return builders()[cfg.data.kind](cfg, tokenizer, rank, world_size, str(run_dir))


def build_eval_loader(cfg: TrainConfig, tokenizer: Any, rank: int, world_size: int, run_dir: Any) -> Optional[EvalLoader]:
    """The validation rows of this rank, or None when there are none.

    map: the prepared validation split (`dataset.val_size`); iterable: the rows the stream index held out
    (`dataset.val_size`) or `dataset.val_paths`, tokenized like training rows; presharded: none."""
    if cfg.data.kind is DataKind.iterable:
        from dsrecipes.data.strategies.iterable import build_eval

        return build_eval(cfg, tokenizer, rank, world_size, str(run_dir))
    val = prepared_val(cfg, run_dir)
    if val is None or len(val) == 0:
        return None
    return EvalLoader(val, rank, world_size, cfg.trainer.micro_batch_size, make_collate(cfg, tokenizer))
