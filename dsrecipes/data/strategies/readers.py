"""The DataLoader over one rank's stream readers (iterable and presharded): one reader per DataLoader worker,
batches made inside the worker, and a check that the rank got exactly its planned number of micro-batches.

Imported when a loader first reads (torch is a second of start-up that `dsrecipes validate`/`audit`, which import the
strategy table, do not pay).
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dsrecipes.core.errors import DataError
from dsrecipes.data.plan.sampler import StreamTooShort
from dsrecipes.data.strategies.base import Batch, iterate, loader_generator, worker_ignores_stop_signals


class ReaderDataset(IterableDataset):
    """torch IterableDataset body: one reader per DataLoader worker; batches are made inside the worker."""

    def __init__(self, loader: Any, *reader_args: Any):
        self.loader, self.reader_args = loader, reader_args

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        lo = self.loader
        try:
            for _micro, items in lo.reader(0 if info is None else info.id, *self.reader_args):
                batch = lo.collate_fn(lo.make_rows(items))
                batch["keys"] = [lo.item_key(item) for item in items]  # positions dealt (data/plan/ledger.py)
                yield batch
        except StreamTooShort as exc:
            raise DataError(
                f"data.num_samples={lo.num_samples} but the stream has only {exc.num_items} samples; "
                "set data.num_samples to the real count (`dsrecipes audit` prints it)"
            ) from None


def run_readers(dataset: ReaderDataset, expected: int, num_workers: int, prefetch_factor: int,
                rank: int) -> Iterator[Batch]:
    """The DataLoader over the readers of one rank; checks it gave the planned number of micro-batches."""
    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers,
                        prefetch_factor=prefetch_factor if num_workers else None,
                        worker_init_fn=worker_ignores_stop_signals,
                        generator=loader_generator(dataset.loader.seed, dataset.loader.epoch))
    produced = 0
    for batch in iterate(loader):  # its workers end with a failing rank (base.end_workers)
        produced += 1
        yield batch
    if produced != expected:
        raise DataError(f"rank {rank}: the stream gave {produced} micro-batches instead of {expected}")
