"""`data=presharded`: rank r streams only `part_<r>.jsonl` of `data.shard_dir` (written by `dsrecipes shard`).

The part count must equal the world size (otherwise a clear error says how to re-shard). Each rank plans its own part
as a world of one (same slot arithmetic, DataLoader workers split its micro-batches round-robin, windowed shuffle
per epoch: `sampler.select_slots`), and every rank runs the steps of the *smallest* part: steps = min over parts of
count // (mbs x accum). Remainder: each rank leaves out count_r - steps x mbs x accum samples of its part (the tail
of that epoch's order, so different samples each epoch with shuffling). With the +-1 balanced parts `shard` writes
(both balance modes), the remainders add up to less than one global batch; hand-made uneven parts lose more, and
`dsrecipes audit` says so. Elastic resume is not possible (parts are tied to ranks); another micro batch size or
accumulation is. Each DataLoader worker of a rank walks the rank's part (reads = workers x part).

Validation: the shard's validation part (`dsrecipes shard --val-size N` holds N samples out of the parts into
`val.jsonl`, listed in the manifest with its checksum), or `dataset.val_paths` (which then wins): the launching
process checks those rows and writes them in canonical form into the run directory. Every rank evaluates a
contiguous share of them.

Pairs (objective.rows=pair): parts written by `dsrecipes shard ... objective=dpo` hold one checked pair per line
(manifest `row_format`, shard_rows.py), a pair being one sample for all of the above; parts of the other row kind
are refused before any rank starts.
"""

from __future__ import annotations

import functools
import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from dsrecipes.core.errors import DataError
from dsrecipes.core.fileio import atomic_writer
from dsrecipes.core.runplan import RunPlan
from dsrecipes.core.schema import DataKind, SourceConfig, TrainConfig
from dsrecipes.core.tokenizer import load_tokenizer
from dsrecipes.data.plan.epoch import Layout, StreamShuffle, presharded_steps, require_steps
from dsrecipes.data.plan.sampler import Item, StreamSpec, select_slots
from dsrecipes.data.prepare.prompts import say_references
from dsrecipes.data.shard.manifest import Manifest, checked_alike, read_manifest, verify_part, verify_val_part
from dsrecipes.data.shard.rows import check_row_format, checked_rows
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.remote import is_url
from dsrecipes.data.strategies.audit import AuditReport, audit_presharded
from dsrecipes.data.strategies.base import Batch, Row, TrainLoader
from dsrecipes.data.strategies.eval import EvalLoader
from dsrecipes.data.strategies.protocol import PrepareResult, RankData, rows_of_plan
from dsrecipes.data.strategies.rows import make_collate, row_encoder
from dsrecipes.data.stream.changed import seen_now, watched
from dsrecipes.data.stream.scan import checking_encoder, scan_sources

VAL_ROWS = "val_rows.jsonl"  # `dataset.val_paths` in canonical form, written by the launching process
VAL_QUARANTINE = "val_quarantine.jsonl"


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
        recheck: Optional[Callable[[], None]] = None,
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
        self.recheck = recheck
        self.watched = seen_now(stream.paths)  # local parts as verified at open: a change mid-run is a DataError

    def set_epoch(self, epoch: int) -> None:
        """A new epoch reads the part again: `recheck` first (a part in a store must still be the object the manifest
        recorded, one HEAD; a replaced one is a DataError, never trained on)."""
        if epoch != self.epoch and self.recheck is not None:
            self.recheck()
        super().set_epoch(epoch)

    def _steps(self, offset: int) -> int:
        return presharded_steps(self.part_counts, self.layout, offset)

    @property
    def steps_per_epoch(self) -> int:
        return self._steps(0)

    def reader(self, worker: int, epoch: int, offset: int, start_micro: int) -> Iterator[Tuple[int, List[Item]]]:
        """(micro, items) of one reader: the exact selection the runtime makes (also what the audit replays)."""
        items = watched(self.stream.items(epoch, self.seed, self.shuffle), self.watched, "the rank verified it")
        return select_slots(items,
                            StreamShuffle(self.seed, epoch, self.shuffle_buffer), self.layout, self.rank, worker,
                            offset=offset, start_micro=start_micro, steps=self._steps(offset))

    def item_key(self, item: Item) -> str:
        """The position of an item: this rank's part and line (parts are disjoint, `dsrecipes shard` proves it)."""
        return f"{os.path.basename(self.stream.paths[item[0]])}:{item[1]}"

    def _batches(self, offset: int, start_micro: int) -> Iterator[Batch]:
        expected = self._steps(offset) * self.layout.grad_accum - start_micro
        if expected <= 0:
            return
        from dsrecipes.data.strategies.readers import (  # lazy: else `commands.train` imports torch 3.80 s
            ReaderDataset,
            run_readers,
        )

        dataset = ReaderDataset(self, self.epoch, offset, start_micro)
        yield from run_readers(dataset, expected, self.num_workers, self.prefetch_factor, self.global_rank)


def part_layout(cfg: Any) -> Layout:
    """A rank's own part is planned as a world of one."""
    t = cfg.trainer
    return Layout(1, t.micro_batch_size, t.grad_accum, cfg.data.num_workers)


@dataclass(frozen=True)
class RankParts:
    """What a presharded rank reads: the manifest (its own part verified) and the validation rows' file, if any."""

    manifest: Manifest
    val_path: Optional[str]


class PreshardedStrategy:
    """`data=presharded`: the parts and manifest written by `dsrecipes shard`; validation rows from the shard's
    validation part (`shard --val-size`) or `dataset.val_paths` (checked and written into the run directory)."""

    kind = DataKind.presharded
    needs_tokenizer = False
    reads_sources = False  # the parts of `dsrecipes shard`: their rows were chosen when sharding

    def identity(self, cfg: TrainConfig, tokenizer: Any) -> Tuple[str, Dict[str, str]]:
        return read_manifest(cfg.data.shard_dir).fingerprint, {}

    def prepare(self, cfg: TrainConfig, run_dir: Path, tokenizer: Any, world_size: int) -> PrepareResult:
        resuming = any(not p.name.endswith(".partial") for p in (run_dir / "checkpoints").glob("step_*"))
        manifest = read_manifest(cfg.data.shard_dir, world_size=world_size, resuming=resuming)
        check_row_format(manifest, cfg)
        if manifest.no_reference is not None:  # prompt rows whose comparing rewards have no reference: said, or refused
            say_references(cfg, manifest.total, manifest.no_reference)
        if cfg.data.prescan:
            check_parts(cfg, run_dir, manifest)
        val = write_val_rows(cfg, run_dir) if cfg.dataset.val_paths else manifest.val_count
        return PrepareResult(manifest.total, manifest.fingerprint, val, detail=tuple(manifest.counts))

    def steps_per_epoch(self, cfg: TrainConfig, layout: Layout, prepared: PrepareResult) -> Optional[int]:
        counts = list(prepared.detail)
        what = f"the smallest part of {cfg.data.shard_dir} ({min(counts)} samples)"
        return require_steps(presharded_steps(counts, layout), what, layout)

    def open(self, cfg: TrainConfig, run_dir: str, rank: int, world_size: int, plan: RunPlan) -> RankParts:
        manifest = read_manifest(cfg.data.shard_dir, world_size=world_size)
        check_row_format(manifest, cfg)
        verify_part(manifest, rank)
        rows_of_plan(plan, manifest.total, run_dir)
        val_path = None
        if cfg.dataset.val_paths:
            val_path = os.path.join(run_dir, VAL_ROWS)
            if not os.path.isfile(val_path):
                raise DataError(f"{val_path}: missing; the launching process writes the dataset.val_paths rows there")
        elif manifest.val_file:
            val_path = verify_val_part(manifest)
        return RankParts(manifest, val_path)

    def train_loader(self, data: RankData) -> PreshardedTrainLoader:
        cfg, manifest, rank = data.cfg, data.source.manifest, data.rank
        path = manifest.part_path(rank)
        return PreshardedTrainLoader(
            StreamSpec((path,), None, cfg.dataset.max_row_bytes), part_layout(cfg), 0, seed=cfg.trainer.seed,
            shuffle=cfg.data.shuffle, shuffle_buffer=cfg.data.shuffle_buffer, num_samples=manifest.counts[rank],
            make_rows=row_encoder(cfg, data.tokenizer, [path], [SourceConfig(name=f"part{rank}")]),
            collate_fn=make_collate(data.cfg, data.tokenizer), num_workers=cfg.data.num_workers,
            prefetch_factor=cfg.data.prefetch_factor, part_counts=manifest.counts, global_rank=rank,
            fingerprint={"manifest_sha256": manifest.sha256},
            recheck=functools.partial(verify_part, manifest, rank) if is_url(path) else None)

    def eval_loader(self, data: RankData) -> Optional[EvalLoader]:
        """This rank's contiguous share of the validation file's rows (canonical JSONL), tokenized."""
        path = data.source.val_path
        if path is None:
            return None
        cfg = data.cfg
        items = list(StreamSpec((path,), None, cfg.dataset.max_row_bytes).items(0, cfg.trainer.seed, False))
        items = items[:cfg.trainer.eval_samples]  # the first N samples (None: all), before ranks share them
        n = len(items)
        first = data.rank * n // data.world_size
        share = items[first:(data.rank + 1) * n // data.world_size]
        rows = row_encoder(cfg, data.tokenizer, [path], [SourceConfig(name="validation")])(share)  # rows <= share
        return EvalLoader(rows, 0, 1, cfg.trainer.micro_batch_size, make_collate(data.cfg, data.tokenizer), first)

    def audit(self, cfg: TrainConfig, layout: Layout, epochs: int, num_rows: Optional[int]) -> AuditReport:
        counts = read_manifest(cfg.data.shard_dir).counts
        return audit_presharded(counts, layout, cfg.trainer.seed, cfg.data.shuffle, cfg.data.shuffle_buffer, epochs)


def check_parts(cfg: TrainConfig, run_dir: Path, manifest: Manifest) -> None:
    """Parts are checked by `dsrecipes shard` with its template and tokenizer; with another one, a row could fail to
    render or tokenize mid-run (or mid-evaluation), so the parts (and the validation part) are scanned first."""

    if checked_alike(manifest.checked_with, cfg, load_tokenizer(cfg)):
        return
    paths = [manifest.part_path(r) for r in range(manifest.parts)]
    if manifest.val_file and not cfg.dataset.val_paths:
        paths.append(manifest.path_of(manifest.val_file))
    scan_sources(cfg, run_dir, [SourceConfig(name=f"part{r}", paths=[glob.escape(p)]) for r, p in enumerate(paths)])


def write_val_rows(cfg: TrainConfig, run_dir: Path) -> int:
    """`dataset.val_paths` read and checked like `dsrecipes shard` checks rows (bad rows per `dataset.bad_rows`,
    quarantined in `<run>/val_quarantine.jsonl`), written in the parts' canonical form to `<run>/val_rows.jsonl`;
    returns the rows written."""

    run_dir = Path(run_dir)
    (run_dir / VAL_QUARANTINE).unlink(missing_ok=True)  # an earlier launch's list, never beside this one's rows
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, run_dir / VAL_QUARANTINE)
    source = SourceConfig(name="validation", paths=list(cfg.dataset.val_paths))
    rows = 0
    try:
        with atomic_writer(run_dir / VAL_ROWS) as fh:
            for line, _ in checked_rows(cfg, report, checking_encoder(cfg, load_tokenizer(cfg)), [source]):
                fh.write(line)
                rows += 1
    finally:
        report.close()
    return rows
