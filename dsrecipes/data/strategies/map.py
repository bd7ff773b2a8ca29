"""`data=map`: the prepared dataset in memory, our own distributed batch sampler over the data-parallel world.

Not DeepSpeed's `training_data=` loader: that one pads the last batch with duplicates, re-splits by its own rules and
never calls `set_epoch`, so it reshuffles nothing and repeats samples. Here each rank's micro-batches come from
`plan.py` (a seeded permutation per epoch; identity with `data.shuffle=false`), and DataLoader workers only fetch
the index lists they are handed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence

from dsrecipes.data.plan import EpochPlan, Layout
from dsrecipes.data.sampler import map_micro_batches
from dsrecipes.data.strategies.base import Batch, Row, TrainLoader, loader_generator, worker_ignores_stop_signals


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
            _Rows(self.rows),
            batch_sampler=batches,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            worker_init_fn=worker_ignores_stop_signals,
            generator=loader_generator(self.seed, self.epoch),
        )
        yield from loader


class _Rows:
    """A map-style view that fetches a whole micro-batch at once (HF datasets read a batch of rows in one call)."""

    def __init__(self, rows: Sequence[Row]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]

    def __getitems__(self, indices: List[int]) -> List[Row]:
        getitems = getattr(self.rows, "__getitems__", None)
        if getitems is not None:
            return list(getitems(indices))
        return [self.rows[i] for i in indices]


def build(cfg: Any, tokenizer: Any, rank: int, world_size: int, run_dir: str) -> MapTrainLoader:
    from dsrecipes.data.prepare import load_prepared
    from dsrecipes.data.strategies.rows import make_collate

    prepared = load_prepared(cfg, run_dir)
    return MapTrainLoader(
        prepared.train,
        Layout.from_cfg(cfg, world_size),
        rank,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        collate_fn=make_collate(cfg, tokenizer),
        num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor,
    )


def num_rows(cfg: Any, run_dir: Optional[str]) -> int:
    from dsrecipes.data.prepare import load_prepared

    return len(load_prepared(cfg, run_dir).train)
