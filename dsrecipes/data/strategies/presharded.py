"""`data=presharded`: rank r streams only `part_<r>.jsonl` of `data.shard_dir` (written by `dsrecipes shard`).

The part count must equal the world size (otherwise a clear error says how to re-shard). Each rank plans its own part
as a world of one (same slot arithmetic, DataLoader workers split its micro-batches round-robin, windowed shuffle
per epoch: `sampler.select_slots`), and every rank runs the steps of the *smallest* part: steps = min over parts of
count // (mbs x accum). Remainder: each rank leaves out count_r - steps x mbs x accum samples of its part (the tail
of that epoch's order, so different samples each epoch with shuffling). With the +-1 balanced parts `shard` writes
(both balance modes), the remainders add up to less than one global batch; hand-made uneven parts lose more, and
`dsrecipes audit` says so. Elastic resume is not possible (parts are tied to ranks); another micro batch size or
accumulation is. Each DataLoader worker of a rank walks the rank's part (reads = workers x part).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from dsrecipes.config.schema import SourceConfig
from dsrecipes.data.plan import Layout, StreamShuffle, presharded_steps
from dsrecipes.data.sampler import Item, StreamSpec, select_slots
from dsrecipes.data.strategies.base import Batch, Row, TrainLoader
from dsrecipes.data.strategies.iterable import ReaderDataset, run_readers


class PreshardedTrainLoader(TrainLoader):
    """A rank's loader over its own part: a world of one; the smallest part sets the steps of every rank."""

    kind = "presharded"

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
        make_rows: Callable[[Sequence[Item]], List[Row]],
        collate_fn: Callable[[List[Row]], Batch],
        part_counts: Sequence[int],
        num_workers: int = 0,
        prefetch_factor: int = 2,
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
        self.part_counts = list(part_counts)

    def _steps(self, offset: int) -> int:
        return presharded_steps(self.part_counts, self.layout, offset)

    @property
    def steps_per_epoch(self) -> int:
        return self._steps(0)

    def reader(self, worker: int, epoch: int, offset: int, start_micro: int) -> Iterator[Tuple[int, List[Item]]]:
        """(micro, items) of one reader: the exact selection the runtime makes (also what the audit replays)."""
        return select_slots(self.stream.items(epoch, self.seed, self.shuffle),
                            StreamShuffle(self.seed, epoch, self.shuffle_buffer), self.layout, self.rank, worker,
                            offset=offset, start_micro=start_micro, steps=self._steps(offset))

    def _batches(self, offset: int, start_micro: int) -> Iterator[Batch]:
        expected = self._steps(offset) * self.layout.grad_accum - start_micro
        if expected <= 0:
            return
        dataset = ReaderDataset(self, self.epoch, offset, start_micro)
        yield from run_readers(dataset, expected, self.num_workers, self.prefetch_factor, self.global_rank)


def part_layout(cfg: Any) -> Layout:
    """A rank's own part is planned as a world of one."""
    t = cfg.trainer
    return Layout(1, t.micro_batch_size, t.grad_accum, cfg.data.num_workers)


def build(cfg: Any, tokenizer: Any, rank: int, world_size: int, run_dir: str) -> PreshardedTrainLoader:
    from dsrecipes.data.shard import read_manifest, verify_part
    from dsrecipes.data.strategies.rows import RowEncoder, make_collate

    manifest = read_manifest(cfg.data.shard_dir, world_size=world_size)
    verify_part(manifest, rank)
    path = manifest.part_path(rank)
    return PreshardedTrainLoader(
        StreamSpec((path,), None, cfg.dataset.max_row_bytes),
        part_layout(cfg),
        0,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        shuffle_buffer=cfg.data.shuffle_buffer,
        num_samples=manifest.counts[rank],
        make_rows=RowEncoder(cfg, tokenizer, [path], [SourceConfig(name=f"part{rank}")]),
        collate_fn=make_collate(cfg, tokenizer),
        num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor,
        part_counts=manifest.counts,
        global_rank=rank,
        fingerprint={"manifest_sha256": manifest.sha256},
    )
