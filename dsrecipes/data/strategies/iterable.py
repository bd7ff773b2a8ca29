"""`data=iterable`: stream JSONL (and converted JSON / gzip) files, tokenize on the fly, read only one's own share.

The launching process indexes the files into blocks and writes `<run>/stream_index.*` (stream/index.py); every
reader (rank x DataLoader worker) computes the epoch's world-size-free order of blocks and its own contiguous
stretch of it (stream/order.py), and reads only the blocks of that stretch (stream/reader.py): about 1/R of the bytes
plus at most two partial blocks, with memory of one shuffle window. The epoch length is the index's count (after
hold-out, mixing weights and `data.num_samples`), so `trainer.epochs` works and every rank knows its steps.

Batching happens inside the worker (torch fetches from workers round-robin, in order), and each rank yields exactly
`steps * grad_accum` micro-batches per epoch. The data state records the epoch's segments, so a resume continues
exactly (same layout) or re-splits what remains (another world size, batch shape or worker count).

Under objective.rows=pair a line is one preference pair and one sample (rows.py `row_encoder` -> `SampleRowEncoder`, the
pre-scan's `PairChecker`); everything above applies to pairs unchanged.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from dsrecipes.core.errors import DataError
from dsrecipes.core.runplan import RunPlan
from dsrecipes.core.schema import (
    DEFAULT_MAX_ROW_BYTES,
    DEFAULT_READ_AHEAD_BYTES,
    DEFAULT_SPAN_BYTES,
    DataKind,
    TrainConfig,
)
from dsrecipes.data.plan.epoch import Layout, count, require_steps, steps_per_epoch
from dsrecipes.data.prepare.cache import data_files, data_fingerprint
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.strategies.audit import AuditReport, audit_stream
from dsrecipes.data.strategies.base import Batch, Row, TrainLoader
from dsrecipes.data.strategies.eval import EvalLoader
from dsrecipes.data.strategies.protocol import PrepareResult, RankData, rows_of_plan
from dsrecipes.data.strategies.rows import make_collate, row_encoder
from dsrecipes.data.stream.index import (
    INDEX_FILE,
    BlockSource,
    StreamIndex,
    build_stream_index,
    file_sources,
    read_stream_index,
)
from dsrecipes.data.stream.order import epoch_visits
from dsrecipes.data.stream.reader import ItemFetcher, read_stretch
from dsrecipes.data.stream.scan import prepare_stream_files
from dsrecipes.data.stream.segments import LocalShuffle, Segment, epoch_segment
from dsrecipes.data.stream.unscanned import TRAINING, VALIDATION, RowsMetUnscanned

STREAM_STATE_VERSION = 2  # 1: the shared-stream filter before block reading
MakeRows = Callable[[Sequence[Any]], List[Row]]


class StreamTrainLoader(TrainLoader):
    """A rank's loader over the block order of a stream: the StreamIndex the launching process wrote (`open`)."""

    kind = "iterable"

    def __init__(self, index: StreamIndex, layout: Layout, rank: int, *, seed: int, shuffle: bool,
                 shuffle_buffer: int, num_samples: Optional[int], make_rows: MakeRows,
                 collate_fn: Callable[[List[Row]], Batch], num_workers: int = 0, prefetch_factor: int = 2,
                 global_rank: Optional[int] = None, fingerprint: Optional[dict] = None,
                 max_row_bytes: int = DEFAULT_MAX_ROW_BYTES, read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
                 span_bytes: int = DEFAULT_SPAN_BYTES):
        self.index = index
        self.table = self.index.table()
        self.total = self.table.epoch_length()
        self.num_samples = num_samples
        self.planned = self.total if num_samples is None else num_samples  # samples of an epoch
        block = self.index.block_bytes
        fingerprint = {"num_samples": self.planned, "shuffle_buffer": shuffle_buffer if shuffle else 0,
                       "files": [os.path.basename(f.name) for f in self.index.files], "block_bytes": block,
                       "chunk_bytes": self.index.blocks_per_chunk * block, **(fingerprint or {})}
        super().__init__(layout, rank, seed, shuffle, fingerprint, global_rank)
        self.shuffle_buffer = shuffle_buffer if shuffle else 0
        self.make_rows, self.collate_fn = make_rows, collate_fn
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.max_row_bytes = max_row_bytes  # longer lines are never read whole (BlockSource)
        self.read_ahead = {"read_ahead_bytes": read_ahead_bytes, "span_bytes": span_bytes}  # objects in a store
        self.history: Tuple[Tuple[Layout, int], ...] = ()  # closed segments of the current epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.planned // self.layout.global_batch

    def check_fingerprint(self, state: Dict[str, Any]) -> None:
        """Another chunking is another order: refused. A checkpoint from before chunks had one block per chunk."""
        saved = state["fingerprint"]
        super().check_fingerprint({**state, "fingerprint": {"chunk_bytes": saved.get("block_bytes"), **saved}})

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
        source = BlockSource(self.index, self.max_row_bytes, **self.read_ahead) if own else source
        fetch = ItemFetcher(epoch_visits(self.table, self.seed, epoch, self.shuffle), source.block, sh)
        try:
            yield from read_stretch(seg, self.rank, v, seg.micros(v, 0, start_micro), sh, fetch)
        finally:
            if own:
                source.close()  # file descriptors: a rank without workers reads every epoch in its own process

    def item_key(self, item: Any) -> str:
        """The position of an item: file, line (element of a JSON array), copy of a weight > 1; unique in an epoch."""
        f, loc, _raw, copy = item
        return f"{self.index.files[f].name}:{loc}" + (f"@{copy}" if copy else "")

    def _batches(self, offset: int, start_micro: int) -> Iterator[Batch]:
        if self.planned > self.total:
            raise DataError(f"data.num_samples={self.num_samples} but the stream has only {self.total} samples; "
                            "set data.num_samples to the real count (`dsrecipes audit` prints it) or leave it unset")
        expected = self.segment().micro_per_rank - start_micro
        if expected <= 0:
            return
        from dsrecipes.data.strategies.readers import (  # lazy: else `commands.train` imports torch 3.80 s
            ReaderDataset,
            run_readers,
        )

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
        self.history = tuple((_layout_of(h), count("history micro", h["micro"])) for h in state["history"])
        self.epoch, self._offset = count("epoch", pos["epoch"]), 0
        if saved == self.layout:
            self._micro = count("micro", pos["micro"])
        else:
            self.history, self._micro = self.history + ((saved, count("micro", pos["micro"])),), 0
        self._start_micro = self._micro


@lru_cache(maxsize=8)
def _segment(planned: int, history: Tuple[Tuple[Layout, int], ...], layout: Layout, sh: LocalShuffle) -> Segment:
    return epoch_segment(planned, history, layout, sh)


def _layout_dict(lay: Layout) -> dict:
    return {"world_size": lay.world_size, "micro_batch_size": lay.micro_batch_size, "grad_accum": lay.grad_accum,
            "num_workers": lay.num_workers}


def _layout_of(d: dict) -> Layout:
    return Layout(*(count(k, d[k], 1) for k in ("world_size", "micro_batch_size", "grad_accum")),
                  count("num_workers", d["num_workers"]))


# ---------------------------------------------------------------------------------------------------------------
# Wiring to the data layer (index in the run directory, rows -> Conversation -> tokens)


class IterableStrategy:
    """`data=iterable`: the launching process indexes (and scans) the files; each rank reads the index once."""

    kind = DataKind.iterable
    needs_tokenizer = False
    reads_sources = True  # its config (dataset.split, pins) selects the rows it trains on
    identity_in_prepare = True  # prepare_stream_files hashes while indexing

    def identity(self, cfg: TrainConfig, tokenizer: Any) -> Tuple[str, Dict[str, str]]:
        sources = resolve_sources(cfg.dataset)
        return data_fingerprint(cfg, sources), data_files(cfg, sources)

    def prepare(self, cfg: TrainConfig, run_dir: Path, tokenizer: Any, world_size: int) -> PrepareResult:
        """Index (and scan) the stream, write `<run>/stream_index.*`: the samples of one epoch, counted."""

        rows, fingerprint, val, files = prepare_stream_files(cfg, run_dir)
        return PrepareResult(rows, fingerprint, val, files=files)

    def steps_per_epoch(self, cfg: TrainConfig, layout: Layout, prepared: PrepareResult) -> Optional[int]:
        rows = cfg.data.num_samples if prepared.rows is None else prepared.rows
        per_epoch = None if rows is None else steps_per_epoch(rows, layout)
        return require_steps(per_epoch, f"{rows} training rows", layout)

    def open(self, cfg: TrainConfig, run_dir: str, rank: int, world_size: int, plan: RunPlan) -> StreamIndex:
        """The index the launching process wrote, checked against the files and the plan (once per rank)."""
        index = read_stream_index(run_dir)
        if index is None:
            raise DataError(f"{run_dir}/{INDEX_FILE}: missing; the launching process indexes the stream before any "
                            "rank starts (start runs with `python -m dsrecipes`)")
        index.verify()
        total = index.table().epoch_length()
        rows_of_plan(plan, total if cfg.data.num_samples is None else cfg.data.num_samples, run_dir)
        return index

    def train_loader(self, data: RankData) -> StreamTrainLoader:
        cfg, index = data.cfg, data.source
        return StreamTrainLoader(index, Layout.from_cfg(cfg, data.world_size), data.rank, seed=cfg.trainer.seed,
                                 shuffle=cfg.data.shuffle, shuffle_buffer=cfg.data.shuffle_buffer,
                                 num_samples=cfg.data.num_samples,
                                 make_rows=stream_rows(cfg, data.tokenizer, index, data.rank, TRAINING),
                                 collate_fn=make_collate(data.cfg, data.tokenizer), num_workers=cfg.data.num_workers,
                                 prefetch_factor=cfg.data.prefetch_factor, max_row_bytes=cfg.dataset.max_row_bytes,
                                 read_ahead_bytes=cfg.data.read_ahead_bytes, span_bytes=cfg.data.span_bytes)

    def eval_loader(self, data: RankData) -> Optional[EvalLoader]:
        """This rank's share of the validation rows (held out by the index, or `dataset.val_paths`), tokenized."""
        cfg, index = data.cfg, data.source
        refs = index.val_refs()[:cfg.trainer.eval_samples]  # the first N samples (None: all), before ranks share them
        if not refs:
            return None
        first = data.rank * len(refs) // data.world_size
        share = refs[first:(data.rank + 1) * len(refs) // data.world_size]
        source = BlockSource(index, cfg.dataset.max_row_bytes)
        rows = stream_rows(cfg, data.tokenizer, index, data.rank, VALIDATION)([(*row, 0) for row in source.rows(share)])
        source.close()  # rows <= samples of the share (skipped, packed): their positions stay inside it
        return EvalLoader(rows, 0, 1, cfg.trainer.micro_batch_size, make_collate(data.cfg, data.tokenizer), first)

    def audit(self, cfg: TrainConfig, layout: Layout, epochs: int, num_rows: Optional[int]) -> AuditReport:
        """The index the launching process builds (cached by content), without the scan."""

        index = build_stream_index(cfg)
        counts = [index.caps[f] for f in index.train_files]
        return audit_stream(counts, layout, cfg.trainer.seed, cfg.data.shuffle, cfg.data.shuffle_buffer, epochs,
                            cfg.data.num_samples, index.table())


def stream_rows(cfg: Any, tokenizer: Any, index: StreamIndex, rank: int = 0, part: str = TRAINING) -> Any:
    """The run objective's rows (conversations, or preference pairs) of the stream's files, read by `rank` (its
    `part`: TRAINING or VALIDATION rows). Without the pre-scan, a bad row's refusal says it is the first that reading
    met (stream/unscanned.py)."""
    rows = row_encoder(cfg, tokenizer, [f.name for f in index.files], file_sources(cfg, index),
                       [f.loc_base < 0 for f in index.files])
    return rows if cfg.data.prescan else RowsMetUnscanned(rows, rank, part)
