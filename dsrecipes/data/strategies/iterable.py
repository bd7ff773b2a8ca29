"""`data=iterable`: stream JSONL (and converted JSON / gzip) files, tokenize on the fly, read only one's own share.

The launching process indexes the files into blocks and writes `<run>/stream_index.*` (stream_index.py); every
reader (rank x DataLoader worker) computes the epoch's world-size-free order of blocks and its own contiguous
stretch of it (stream_plan.py), and reads only the blocks of that stretch (stream_reader.py): about 1/R of the bytes
plus at most two partial blocks, with memory of one shuffle window. The epoch length is the index's count (after
hold-out, mixing weights and `data.num_samples`), so `trainer.epochs` works and every rank knows its steps.

Batching happens inside the worker (torch fetches from workers round-robin, in order), and each rank yields exactly
`steps * grad_accum` micro-batches per epoch. The data state records the epoch's segments, so a resume continues
exactly (same layout) or re-splits what remains (another world size, batch shape or worker count).
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from torch.utils.data import IterableDataset

from dsrecipes.config.schema import DEFAULT_MAX_ROW_BYTES
from dsrecipes.data.plan import Layout
from dsrecipes.data.sampler import StreamSpec, StreamTooShort
from dsrecipes.data.strategies.base import Batch, Row, TrainLoader, loader_generator, worker_ignores_stop_signals
from dsrecipes.data.stream_index import BlockSource, StreamIndex
from dsrecipes.data.stream_plan import epoch_visits
from dsrecipes.data.stream_reader import ItemFetcher, read_stretch
from dsrecipes.data.stream_segments import LocalShuffle, Segment, epoch_segment
from dsrecipes.errors import DataError

STREAM_STATE_VERSION = 2  # 1: the shared-stream filter before block reading
MakeRows = Callable[[Sequence[Any]], List[Row]]


class StreamTrainLoader(TrainLoader):
    """A rank's loader over the block order of a stream (a StreamIndex, or a StreamSpec indexed on the spot)."""

    kind = "iterable"

    def __init__(self, stream: StreamIndex | StreamSpec, layout: Layout, rank: int, *, seed: int, shuffle: bool,
                 shuffle_buffer: int, num_samples: Optional[int], make_rows: MakeRows,
                 collate_fn: Callable[[List[Row]], Batch], num_workers: int = 0, prefetch_factor: int = 2,
                 global_rank: Optional[int] = None, fingerprint: Optional[dict] = None,
                 max_row_bytes: int = DEFAULT_MAX_ROW_BYTES):
        from dsrecipes.data.stream_index import index_spec

        self.index = stream if isinstance(stream, StreamIndex) else index_spec(stream)
        self.table = self.index.table()
        self.total = self.table.epoch_length()
        self.num_samples = num_samples
        self.planned = self.total if num_samples is None else num_samples  # samples of an epoch
        fingerprint = {"num_samples": self.planned, "shuffle_buffer": shuffle_buffer if shuffle else 0,
                       "files": [os.path.basename(f.name) for f in self.index.files],
                       "block_bytes": self.index.block_bytes, **(fingerprint or {})}
        super().__init__(layout, rank, seed, shuffle, fingerprint, global_rank)
        self.shuffle_buffer = shuffle_buffer if shuffle else 0
        self.make_rows, self.collate_fn = make_rows, collate_fn
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.max_row_bytes = max_row_bytes  # longer lines are never read whole (BlockSource)
        self.history: Tuple[Tuple[Layout, int], ...] = ()  # closed segments of the current epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.planned // self.layout.global_batch

    def local_shuffle(self, epoch: int) -> LocalShuffle:
        return LocalShuffle(self.seed, epoch, self.shuffle_buffer, self.shuffle)

    def segment(self, epoch: Optional[int] = None) -> Segment:
        """What this layout reads of `epoch` (default: the current one) after the recorded segments."""
        epoch = self.epoch if epoch is None else epoch
        return _segment(self.planned, self.history, self.layout, self.local_shuffle(epoch))

    def reader(self, worker: int, epoch: int, start_micro: int, source: Optional[BlockSource] = None
               ) -> Iterator[Tuple[int, List[Any]]]:
        """(micro, items) of DataLoader worker `worker`: it serves stretch (worker + start_micro) % W."""
        seg, sh = self.segment(epoch), self.local_shuffle(epoch)
        v = (worker + start_micro) % self.layout.readers_per_rank
        own = source is None
        source = BlockSource(self.index, self.max_row_bytes) if own else source
        fetch = ItemFetcher(epoch_visits(self.table, self.seed, epoch, self.shuffle), source.block, sh)
        try:
            yield from read_stretch(seg, self.rank, v, seg.micros(v, 0, start_micro), sh, fetch)
        finally:
            if own:
                source.close()  # file descriptors: a rank without workers reads every epoch in its own process

    def _batches(self, offset: int, start_micro: int) -> Iterator[Batch]:
        if self.planned > self.total:
            raise DataError(f"data.num_samples={self.num_samples} but the stream has only {self.total} samples; "
                            "set data.num_samples to the real count (`dsrecipes audit` prints it) or leave it unset")
        expected = self.segment().micro_per_rank - start_micro
        if expected <= 0:
            return
        dataset = ReaderDataset(self, self.epoch, start_micro)
        yield from run_readers(dataset, expected, self.num_workers, self.prefetch_factor, self.global_rank)

    # -- epochs and the resume state ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.history = ()
        super().set_epoch(epoch)

    def samples_consumed(self) -> int:
        done = sum(d * lay.world_size * lay.micro_batch_size for lay, d in self.history)
        return done + self._micro * self.layout.world_size * self.layout.micro_batch_size

    def state_dict(self) -> dict:
        return {"version": STREAM_STATE_VERSION, "rank": self.global_rank,
                "position": {"epoch": self.epoch, "micro": self._micro, **_layout_dict(self.layout)},
                "history": [{**_layout_dict(lay), "micro": d} for lay, d in self.history],
                "samples_consumed": self.samples_consumed(), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Same layout: continue the saved segment exactly. Another layout: close it and plan what remains."""
        if state.get("version") != STREAM_STATE_VERSION:
            raise DataError(f"data state version {state.get('version')!r}: written for another data=iterable order "
                            f"(this one is {STREAM_STATE_VERSION}); start a fresh run (trainer.resume=never)")
        self.check_fingerprint(state)
        pos = dict(state["position"])
        saved = _layout_of(pos)
        self.history = tuple((_layout_of(h), h["micro"]) for h in state["history"])
        self.epoch, self._offset = pos["epoch"], 0
        if saved == self.layout:
            self._micro = pos["micro"]
        else:
            self.history, self._micro = self.history + ((saved, pos["micro"]),), 0
        self._start_micro = self._micro


@lru_cache(maxsize=8)
def _segment(planned: int, history: Tuple[Tuple[Layout, int], ...], layout: Layout, sh: LocalShuffle) -> Segment:
    return epoch_segment(planned, history, layout, sh)


def _layout_dict(lay: Layout) -> dict:
    return {"world_size": lay.world_size, "micro_batch_size": lay.micro_batch_size, "grad_accum": lay.grad_accum,
            "num_workers": lay.num_workers}


def _layout_of(d: dict) -> Layout:
    return Layout(d["world_size"], d["micro_batch_size"], d["grad_accum"], d["num_workers"])


class ReaderDataset(IterableDataset):
    """torch IterableDataset body: one reader per DataLoader worker; batches are made inside the worker."""

    def __init__(self, loader: Any, *reader_args: Any):
        self.loader, self.reader_args = loader, reader_args

    def __iter__(self) -> Iterator[Batch]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        lo = self.loader
        try:
            for _micro, items in lo.reader(0 if info is None else info.id, *self.reader_args):
                yield lo.collate_fn(lo.make_rows(items))
        except StreamTooShort as exc:
            raise DataError(
                f"data.num_samples={lo.num_samples} but the stream has only {exc.num_items} samples; "
                "set data.num_samples to the real count (`dsrecipes audit` prints it)"
            ) from None


def run_readers(dataset: ReaderDataset, expected: int, num_workers: int, prefetch_factor: int,
                rank: int) -> Iterator[Batch]:
    """The DataLoader over the readers of one rank; checks it gave the planned number of micro-batches."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=None, num_workers=num_workers,
                        prefetch_factor=prefetch_factor if num_workers else None,
                        worker_init_fn=worker_ignores_stop_signals,
                        generator=loader_generator(dataset.loader.seed, dataset.loader.epoch))
    produced = 0
    for batch in loader:
        produced += 1
        yield batch
    if produced != expected:
        raise DataError(f"rank {rank}: the stream gave {produced} micro-batches instead of {expected}")


# ---------------------------------------------------------------------------------------------------------------
# Wiring to the data layer (index in the run directory, rows -> Conversation -> tokens)


def run_index(cfg: Any, run_dir: str) -> StreamIndex:
    """The index the launching process wrote, checked against the files; built here only without one (tests)."""
    from dsrecipes.data.stream_index import build_stream_index, read_stream_index

    index = read_stream_index(run_dir)
    index = build_stream_index(cfg) if index is None else index
    index.verify()
    return index


def row_encoder(cfg: Any, tokenizer: Any, index: StreamIndex) -> Any:
    from dsrecipes.data.strategies.rows import RowEncoder
    from dsrecipes.data.stream_index import file_sources

    return RowEncoder(cfg, tokenizer, [f.name for f in index.files], file_sources(cfg, index),
                      [f.loc_base < 0 for f in index.files])


def build(cfg: Any, tokenizer: Any, rank: int, world_size: int, run_dir: str) -> StreamTrainLoader:
    from dsrecipes.data.strategies.rows import make_collate

    index = run_index(cfg, run_dir)
    loader = StreamTrainLoader(index, Layout.from_cfg(cfg, world_size), rank, seed=cfg.trainer.seed,
                               shuffle=cfg.data.shuffle, shuffle_buffer=cfg.data.shuffle_buffer,
                               num_samples=cfg.data.num_samples, make_rows=row_encoder(cfg, tokenizer, index),
                               collate_fn=make_collate(cfg, tokenizer), num_workers=cfg.data.num_workers,
                               prefetch_factor=cfg.data.prefetch_factor, max_row_bytes=cfg.dataset.max_row_bytes)
    _check_rows(run_dir, loader.planned)
    return loader


def _check_rows(run_dir: str, planned: int) -> None:
    from pathlib import Path

    from dsrecipes.runplan import PLAN_FILE, read_plan

    if (Path(run_dir) / PLAN_FILE).is_file():
        rows = read_plan(run_dir).rows
        if rows is not None and rows != planned:
            raise DataError(f"{run_dir}/{PLAN_FILE} plans {rows} samples per epoch, this rank's stream has {planned}: "
                            "the data changed since the launching process planned the run; start it again")


def build_eval(cfg: Any, tokenizer: Any, rank: int, world_size: int, run_dir: str) -> Any:
    """This rank's share of the validation rows (held out by the index, or `dataset.val_paths`), tokenized."""
    from dsrecipes.data.strategies.eval import EvalLoader
    from dsrecipes.data.strategies.rows import make_collate

    index = run_index(cfg, run_dir)
    refs = index.val_refs()
    if not refs:
        return None
    share = refs[rank * len(refs) // world_size:(rank + 1) * len(refs) // world_size]
    source = BlockSource(index, cfg.dataset.max_row_bytes)
    rows = row_encoder(cfg, tokenizer, index)([(*row, 0) for row in source.rows(share)])
    source.close()
    return EvalLoader(rows, 0, 1, cfg.trainer.micro_batch_size, make_collate(cfg, tokenizer))
