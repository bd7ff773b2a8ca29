"""`data=iterable`: stream JSONL shards, tokenize on the fly, never materialise the data.

Reading is shared at the sample level by every reader of the world (rank x DataLoader worker): all readers walk the
same line stream (files in a per-epoch order, then a windowed shuffle of `data.shuffle_buffer` lines), and each one
parses and tokenizes only the lines whose position falls in its own micro-batch slots (`plan.py`). So it is correct
with fewer files than readers and with very uneven files, memory stays one shuffle window, and the order does not
depend on the world size (elastic resume). The cost: every reader scans every line's bytes (no JSON parse for the
lines it skips); parsing and tokenization, the expensive part, are divided by the number of readers.

Batching happens inside the worker (torch fetches from workers round-robin, in order), and each rank yields exactly
`steps * grad_accum` micro-batches per epoch. With `data.num_samples` the epoch is planned from that count (checked
against the files when the loader is built); with only a step budget the stream cycles epochs endlessly, each epoch
ending at the last whole global batch that every reader sees.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from torch.utils.data import IterableDataset

from dsrecipes.data.plan import EpochPlan, Layout, StreamShuffle, presharded_steps
from dsrecipes.data.sampler import Item, StreamSpec, StreamTooShort, select_slots, stream_spec
from dsrecipes.data.strategies.base import Batch, Row, TrainLoader
from dsrecipes.errors import DataError

MakeRows = Callable[[Sequence[Item]], List[Row]]


class StreamTrainLoader(TrainLoader):
    """A rank's loader over a line stream; `iterable` (shared stream) and `presharded` (own part) both use it."""

    kind = "iterable"

    def __init__(
        self,
        stream: StreamSpec,
        layout: Layout,
        rank: int,
        *,
        seed: int,
        shuffle: bool,
        shuffle_buffer: int,
        num_samples: Optional[int],
        make_rows: MakeRows,
        collate_fn: Callable[[List[Row]], Batch],
        num_workers: int = 0,
        prefetch_factor: int = 2,
        part_counts: Optional[Sequence[int]] = None,
        global_rank: Optional[int] = None,
        fingerprint: Optional[dict] = None,
    ):
        fingerprint = {
            "num_samples": num_samples,
            "shuffle_buffer": shuffle_buffer if shuffle else 0,
            "files": [os.path.basename(p) for p in stream.paths],
            **(fingerprint or {}),
        }
        super().__init__(layout, rank, seed, shuffle, fingerprint, global_rank)
        self.stream = stream
        self.shuffle_buffer = shuffle_buffer if shuffle else 0
        self.num_samples = num_samples
        self.make_rows = make_rows
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        # presharded: the stream is this rank's own part (a world of one); the smallest part sets the steps
        self.part_counts = None if part_counts is None else list(part_counts)

    def _steps(self, offset: int) -> Optional[int]:
        if self.part_counts is not None:
            return presharded_steps(self.part_counts, self.layout, offset)
        if self.num_samples is None:
            return None
        return EpochPlan(self.num_samples, self.layout, offset).steps

    @property
    def steps_per_epoch(self) -> Optional[int]:
        return self._steps(0)


    def shuffler(self, epoch: int) -> StreamShuffle:
        return StreamShuffle(self.seed, epoch, self.shuffle_buffer)

    def reader(self, worker: int, epoch: int, offset: int, start_micro: int) -> Iterator[Tuple[int, List[Item]]]:
        """(micro, items) of one reader: the exact selection the runtime makes (also what the audit replays)."""
        return select_slots(
            self.stream.items(epoch, self.seed, self.shuffle),
            self.shuffler(epoch),
            self.layout,
            self.rank,
            worker,
            offset=offset,
            start_micro=start_micro,
            steps=self._steps(offset),
        )

    def _batches(self, offset: int, start_micro: int) -> Iterator[Batch]:
        from torch.utils.data import DataLoader

        steps = self._steps(offset)
        expected = None if steps is None else steps * self.layout.grad_accum - start_micro
        if expected is not None and expected <= 0:
            return
        dataset = _ReaderDataset(self, self.epoch, offset, start_micro)
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
        )
        produced = 0
        for batch in loader:
            produced += 1
            yield batch
        if expected is not None and produced != expected:
            raise DataError(f"rank {self.global_rank}: the stream gave {produced} micro-batches instead of {expected}")
        if expected is None and produced == 0 and offset == 0 and start_micro == 0:
            raise DataError(
                f"epoch {self.epoch}: the stream does not fill one global batch of {self.layout.global_batch} "
                "samples; use more data, fewer ranks or a smaller batch"
            )


class _ReaderDataset(IterableDataset):
    """torch IterableDataset body: one reader = (rank, DataLoader worker); batches are made inside the worker."""

    def __init__(self, loader: StreamTrainLoader, epoch: int, offset: int, start_micro: int):
        self.loader, self.epoch, self.offset, self.start_micro = loader, epoch, offset, start_micro

    def __iter__(self) -> Iterator[Batch]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = 0 if info is None else info.id
        lo = self.loader
        try:
            for _micro, items in lo.reader(worker, self.epoch, self.offset, self.start_micro):
                yield lo.collate_fn(lo.make_rows(items))
        except StreamTooShort as exc:
            raise DataError(
                f"data.num_samples={lo.num_samples} but the stream has only {exc.num_items} samples; "
                "set data.num_samples to the real count (`dsrecipes audit` prints it)"
            ) from None


# ---------------------------------------------------------------------------------------------------------------
# Wiring to the data layer (sources -> files, rows -> Conversation -> tokens).


def build(cfg: Any, tokenizer: Any, rank: int, world_size: int, run_dir: str) -> StreamTrainLoader:
    from dsrecipes.data.strategies.eval import validation_ids
    from dsrecipes.data.strategies.rows import RowEncoder, make_collate

    stream, file_sources = stream_spec(cfg)
    num_samples = cfg.data.num_samples
    if num_samples is not None:
        have = stream.num_rows()
        if have < num_samples:
            raise DataError(
                f"data.num_samples={num_samples} but the files hold {have} samples; set data.num_samples={have}"
            )
    return StreamTrainLoader(
        stream,
        Layout.from_cfg(cfg, world_size),
        rank,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        shuffle_buffer=cfg.data.shuffle_buffer,
        num_samples=num_samples,
        make_rows=RowEncoder(cfg, tokenizer, stream.paths, file_sources, validation_ids(cfg, run_dir)),
        collate_fn=make_collate(tokenizer),
        num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor,
    )
