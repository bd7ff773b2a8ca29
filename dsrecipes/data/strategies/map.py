"""`data=map`: the prepared dataset in memory, our own distributed batch sampler over the data-parallel world.

Not DeepSpeed's `training_data=` loader: that one pads the last batch with duplicates, re-splits by its own rules and
never calls `set_epoch`, so it reshuffles nothing and repeats samples. Here each rank's micro-batches come from
`plan.py` (a seeded permutation per epoch; identity with `data.shuffle=false`), and DataLoader workers only fetch
the index lists they are handed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from dsrecipes.core.runplan import RunPlan
from dsrecipes.core.schema import DataKind, TrainConfig
from dsrecipes.core.tokenizer import load_tokenizer
from dsrecipes.data.plan.epoch import EpochPlan, Layout, require_steps, steps_per_epoch
from dsrecipes.data.plan.sampler import map_micro_batches
from dsrecipes.data.prepare.build import load_prepared, preparation_key, prepare
from dsrecipes.data.prepare.cache import data_files
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.strategies.audit import AuditReport, audit_map
from dsrecipes.data.strategies.base import (
    Batch,
    Row,
    TrainLoader,
    iterate,
    loader_generator,
    worker_ignores_stop_signals,
)
from dsrecipes.data.strategies.eval import EvalLoader, limit_rows
from dsrecipes.data.strategies.protocol import PrepareResult, RankData, rows_of_plan
from dsrecipes.data.strategies.rows import make_collate
from dsrecipes.data.stream.changed import Seen, changed, differences


class MapTrainLoader(TrainLoader):
    kind = "map"

    def __init__(
        self,
        rows: Sequence[Row],
        layout: Layout,
        rank: int,
        *,
        seed: int,
        shuffle: bool,
        collate_fn: Callable[[List[Row]], Batch],
        num_workers: int = 0,
        prefetch_factor: int = 2,
    ):
        super().__init__(layout, rank, seed, shuffle, {"num_samples": len(rows)})
        self.rows = rows
        self.watched = cache_files_seen(rows)  # the prepared cache as the rank opened it (changed.py)
        self.num_samples = len(rows)
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor

    @property
    def steps_per_epoch(self) -> int:
        return EpochPlan(self.num_samples, self.layout).steps

    def plan(self, offset: int = 0, start_micro: int = 0) -> EpochPlan:
        return EpochPlan(self.num_samples, self.layout, offset, start_micro)

    def micro_batches(self, offset: int = 0, start_micro: int = 0) -> List[List[int]]:
        """Row indices of this rank's remaining micro-batches of the current epoch."""
        return map_micro_batches(self.plan(offset, start_micro), self.rank, self.seed, self.epoch, self.shuffle)

    def _batches(self, offset: int, start_micro: int) -> Iterator[Batch]:
        from torch.utils.data import DataLoader

        batches = self.micro_batches(offset, start_micro)
        if not batches:
            return
        loader = DataLoader(
            _Rows(self.rows, self.watched),
            batch_sampler=batches,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            worker_init_fn=worker_ignores_stop_signals,
            generator=loader_generator(self.seed, self.epoch),
        )
        for batch, rows in zip(iterate(loader), batches):  # its workers end with a failing rank (base.end_workers)
            batch["keys"] = [f"row{i}" for i in rows]  # the ledger's exactly-once check (data/plan/ledger.py)
            yield batch


class _Rows:
    """A map-style view that fetches a whole micro-batch at once (HF datasets read a batch of rows in one call)."""

    def __init__(self, rows: Sequence[Row], watched: Sequence[Tuple[str, Seen]] = ()):
        self.rows = rows
        self.watched = watched

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: List[int]) -> List[Row]:
        for path, seen in self.watched:  # before the memory-mapped read: a changed cache is a DataError, not SIGBUS
            try:
                what = differences(seen, os.stat(path))
            except OSError:
                what = ["removed"]
            if what:
                raise changed(path, what, "the rank opened the prepared data")
        getitems = getattr(self.rows, "__getitems__", None)
        if getitems is not None:
            return list(getitems(indices))
        return [self.rows[i] for i in indices]


def cache_files_seen(rows: Any) -> List[Tuple[str, Seen]]:
    """The files behind a prepared (memory-mapped) split, as they are now: (path, size, mtime, inode)."""
    out = []
    for entry in getattr(rows, "cache_files", None) or []:
        with contextlib.suppress(OSError, KeyError, TypeError):
            st = os.stat(entry["filename"])
            out.append((entry["filename"], Seen(st.st_size, st.st_mtime_ns, st.st_ino)))
    return out


class MapStrategy:
    """`data=map`: prepared once by the launching process (data/prepare/build.py), re-opened by each rank."""

    kind = DataKind.map
    needs_tokenizer = True  # the preparation cache key hashes the tokenizer
    reads_sources = True  # its config (dataset.split, pins) selects the rows it trains on

    def identity(self, cfg: TrainConfig, tokenizer: Any) -> Tuple[str, Dict[str, str]]:
        sources = resolve_sources(cfg.dataset)
        return preparation_key(cfg, tokenizer, sources), data_files(cfg, sources)

    def prepare(self, cfg: TrainConfig, run_dir: Path, tokenizer: Any, world_size: int) -> PrepareResult:
        prepared = prepare(cfg, tokenizer, run_dir)
        val = 0 if prepared.val is None else len(prepared.val)
        return PrepareResult(len(prepared.train), prepared.stats["cache_key"], val)

    def steps_per_epoch(self, cfg: TrainConfig, layout: Layout, prepared: PrepareResult) -> Optional[int]:
        return require_steps(steps_per_epoch(prepared.rows, layout), f"{prepared.rows} training rows", layout)

    def open(self, cfg: TrainConfig, run_dir: str, rank: int, world_size: int, plan: RunPlan) -> Any:
        prepared = load_prepared(cfg, run_dir)
        rows_of_plan(plan, len(prepared.train), run_dir)
        return prepared

    def train_loader(self, data: RankData) -> MapTrainLoader:
        cfg = data.cfg
        return MapTrainLoader(data.source.train, Layout.from_cfg(cfg, data.world_size), data.rank,
                              seed=cfg.trainer.seed, shuffle=cfg.data.shuffle, collate_fn=make_collate(data.cfg, data.tokenizer),
                              num_workers=cfg.data.num_workers, prefetch_factor=cfg.data.prefetch_factor)

    def eval_loader(self, data: RankData) -> Optional[EvalLoader]:
        """The prepared validation split (`dataset.val_paths`, else `dataset.val_size` held out)."""
        val = data.source.val
        if val is None or len(val) == 0:
            return None
        val = limit_rows(val, data.cfg.trainer.eval_samples)  # the first N samples, before they are dealt to ranks
        return EvalLoader(val, data.rank, data.world_size, data.cfg.trainer.micro_batch_size,
                          make_collate(data.cfg, data.tokenizer))

    def audit(self, cfg: TrainConfig, layout: Layout, epochs: int, num_rows: Optional[int]) -> AuditReport:
        """The prepared train split (tokenized and cached, exactly the rows a run trains on), or `num_rows`."""
        rows = prepared_rows(cfg) if num_rows is None else num_rows
        return audit_map(rows, layout, cfg.trainer.seed, cfg.data.shuffle, epochs)


def prepared_rows(cfg: TrainConfig) -> int:
    """Rows of the prepared train split (the data layer's cache makes a second call cheap)."""


    with tempfile.TemporaryDirectory(prefix="dsrecipes-audit-") as run_dir:
        return len(prepare(cfg, load_tokenizer(cfg), run_dir).train)
