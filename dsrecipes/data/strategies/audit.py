"""`dsrecipes audit [overrides] --world-size N --num-workers W --epochs E`: prove the data plan before a run.

Without a model or a process group, computes which samples every rank x DataLoader worker reads in each epoch with
the planner the loaders run (`plan.py`: `EpochPlan.owner`, `epoch_order`, `StreamShuffle`; `stream/order.py` and
`stream/segments.py`: block visits, segments, stretches, local windows), then checks the guarantees: (1) no sample
read twice within an epoch, every sample read except a remainder smaller than one global batch; (2) the same number
of micro-batches and optimizer steps on every rank. Exit 0 when they hold, 1 listing the first violations. For
small inputs it also replays each `data=iterable` reader's own code (`stream_reader.read_stretch`) and compares it
with the plan.

Sample counts come from each strategy's `audit` (data/strategies/): `map` uses the prepared train split (tokenized
and cached by the data layer, exactly the rows a run trains on; `--num-rows N` audits a hypothetical size instead);
`iterable` builds the stream index the launching process builds (blocks, caps, held-out validation rows, mixing
weights); `presharded` reads the manifest. This module is the arithmetic only (no files). `--ledger RUN_DIR` checks
a finished run's ledger instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.data.plan.epoch import EpochPlan, Layout, StreamShuffle, epoch_order, presharded_steps
from dsrecipes.data.plan.sampler import map_rank_rows
from dsrecipes.data.stream.order import BlockTable, Visits, epoch_visits, items_at
from dsrecipes.data.stream.reader import ItemFetcher, read_stretch
from dsrecipes.data.stream.segments import LocalShuffle, Segment, epoch_segment, stretch_positions

REPLAY_LIMIT = 2_000_000  # items x readers up to which stream readers are replayed one by one
AUDIT_BLOCK = 256  # lines per block when an audit is given line counts only (the CLI uses the real index)


@dataclass
class EpochAudit:
    epoch: int
    num_samples: int
    global_batch: int
    micro_per_rank: List[int]
    samples_per_rank: List[int]
    samples_per_worker: List[List[int]]
    read_twice: int
    not_read: int
    remainder_bound: int
    remainder_ids: np.ndarray = field(repr=False)
    grad_accum: int = 1

    @property
    def steps_per_rank(self) -> List[int]:
        return [m // self.grad_accum for m in self.micro_per_rank]


@dataclass
class AuditReport:
    header: str
    epochs: List[EpochAudit] = field(default_factory=list)
    violations: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def render(self, verbose: bool = False) -> str:
        lines = [self.header]
        for ep in self.epochs:
            steps = ep.steps_per_rank
            read = sum(ep.samples_per_rank)
            lines.append(
                f"epoch {ep.epoch}: {steps[0] if len(set(steps)) == 1 else steps} steps per rank, {read} of "
                f"{ep.num_samples} samples read, {ep.read_twice} read twice, {ep.not_read} not read "
                f"(remainder bound {ep.remainder_bound})"
            )
            ranks = range(len(steps))
            shown = ranks if verbose or len(steps) <= 16 else [*ranks[:4], *ranks[-2:]]
            lines.append("  rank  steps  micro  samples  per worker")
            for r in shown:
                per_worker = " ".join(str(n) for n in ep.samples_per_worker[r])
                lines.append(f"  {r:<5} {steps[r]:<6} {ep.micro_per_rank[r]:<6} {ep.samples_per_rank[r]:<8} {per_worker}")
            if len(shown) < len(steps):
                lines.append(f"  ... {len(steps) - len(shown)} more ranks (--verbose); samples per rank "
                             f"{min(ep.samples_per_rank)}-{max(ep.samples_per_rank)}")
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"VIOLATION: {v}" for v in self.violations[:20]]
        lines.append("OK: no sample read twice, remainder below one global batch, equal steps on every rank"
                     if self.ok else f"FAILED: {len(self.violations)} violation(s)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# One epoch: readers -> checks


def _check_epoch(epoch: int, num_samples: int, layout: Layout, reads: Sequence[Tuple[int, int, np.ndarray, np.ndarray]],
                 remainder_bound: int, world_size: int, report: AuditReport) -> EpochAudit:
    """`reads`: (rank, worker, micro numbers [k], sample ids [k, mbs]) of every reader."""
    readers = layout.readers_per_rank
    micro_sets: List[List[np.ndarray]] = [[] for _ in range(world_size)]
    per_worker = [[0] * readers for _ in range(world_size)]
    all_samples = []
    for rank, worker, micros, samples in reads:
        micro_sets[rank].append(micros)
        per_worker[rank][worker] += samples.size
        all_samples.append(samples.ravel())
        if samples.size and samples.shape[1] != layout.micro_batch_size:
            report.violations.append(f"epoch {epoch} rank {rank} worker {worker}: micro-batches of {samples.shape[1]}")
    flat = np.concatenate(all_samples) if all_samples else np.zeros(0, dtype=np.int64)
    hits = np.bincount(flat, minlength=num_samples) if flat.size else np.zeros(num_samples, dtype=np.int64)
    micro_per_rank = []
    for rank in range(world_size):
        micros = np.concatenate(micro_sets[rank]) if micro_sets[rank] else np.zeros(0, dtype=np.int64)
        unique = np.unique(micros)
        if unique.size != micros.size:
            report.violations.append(f"epoch {epoch} rank {rank}: a micro-batch number is produced by two workers")
        micro_per_rank.append(int(unique.size))
    ep = EpochAudit(
        epoch, num_samples, layout.global_batch, micro_per_rank, [sum(w) for w in per_worker], per_worker,
        int((hits > 1).sum()), int((hits == 0).sum()), remainder_bound, np.flatnonzero(hits == 0), layout.grad_accum,
    )
    twice = np.flatnonzero(hits > 1)
    if twice.size:
        report.violations.append(f"epoch {epoch}: {twice.size} samples read more than once, e.g. rows {twice[:5].tolist()}")
    if ep.not_read >= remainder_bound:
        report.violations.append(f"epoch {epoch}: {ep.not_read} samples not read (must be < {remainder_bound})")
    if len(set(micro_per_rank)) > 1:
        report.violations.append(f"epoch {epoch}: micro-batches per rank differ: {sorted(set(micro_per_rank))}")
    if any(m % layout.grad_accum for m in micro_per_rank):
        report.violations.append(f"epoch {epoch}: micro-batches per rank not a multiple of grad_accum")
    if micro_per_rank and micro_per_rank[0] == 0:
        report.violations.append(f"epoch {epoch}: no step at all ({num_samples} samples < one global batch)")
    return ep


def _remainder_note(report: AuditReport, shuffled: bool) -> None:
    rems = [set(ep.remainder_ids.tolist()) for ep in report.epochs if ep.not_read]
    if len(rems) > 1 and shuffled:
        same = all(r == rems[0] for r in rems[1:])
        report.notes.append("the unread remainder is the same in every epoch" if same
                            else "the unread remainder changes between epochs (shuffled)")


# ---------------------------------------------------------------------------------------------------------------
# Strategies


def audit_map(num_rows: int, layout: Layout, seed: int, shuffle: bool, epochs: int) -> AuditReport:
    report = AuditReport(_header("map", f"{num_rows} rows", layout, seed, shuffle))
    for epoch in range(epochs):
        plan = EpochPlan(num_rows, layout)
        order = epoch_order(num_rows, seed, epoch, shuffle)
        reads = []
        for rank in range(layout.world_size):
            for worker in range(layout.readers_per_rank):
                micros = np.asarray(plan.rank_micros(rank, worker), dtype=np.int64)
                reads.append((rank, worker, micros, map_rank_rows(plan, rank, order, worker)))
        report.epochs.append(_check_epoch(epoch, num_rows, layout, reads, layout.global_batch, layout.world_size, report))
    _remainder_note(report, shuffle)
    return report


def audit_stream(counts: Sequence[int], layout: Layout, seed: int, shuffle: bool, buffer: int, epochs: int,
                 num_samples: Optional[int] = None, table: Optional[BlockTable] = None) -> AuditReport:
    """`data=iterable`: files of `counts` lines (blocks of `table`; default AUDIT_BLOCK lines each) read in the
    block order of stream/order.py (num_samples: the planned length)."""
    table = BlockTable.uniform(counts, AUDIT_BLOCK) if table is None else table
    total = table.epoch_length()
    what = f"{len(counts)} files, {int(sum(counts))} lines" + ("" if total == sum(counts) else f", {total} per epoch")
    what += "" if num_samples is None else f", data.num_samples={num_samples}"
    report = AuditReport(_header("iterable", what, layout, seed, shuffle, buffer if shuffle else 0))
    if num_samples is not None and total < num_samples:
        report.violations.append(f"data.num_samples={num_samples} but the files hold {total} lines")
        return report
    if num_samples is not None and total - num_samples >= layout.global_batch:
        report.notes.append(f"data.num_samples={num_samples} is below the {total} lines of the files, so the plan "
                            f"never reaches the last {total - num_samples}; set data.num_samples={total}")
    for epoch in range(epochs):
        sh = LocalShuffle(seed, epoch, buffer, shuffle)
        visits = epoch_visits(table, seed, epoch, shuffle)
        sample_at, uniq = _sample_numbers(table, visits, seed, epoch, shuffle)
        if uniq.size != visits.total:
            report.violations.append(f"epoch {epoch}: the order holds {visits.total - uniq.size} repeated samples")
        seg = epoch_segment(total if num_samples is None else num_samples, (), layout, sh)
        reads = block_reads(seg, sh, sample_at)
        report.epochs.append(_check_epoch(epoch, total, layout, reads, layout.global_batch, layout.world_size, report))
        if total * layout.num_readers <= REPLAY_LIMIT:
            _replay(report, epoch, table, visits, seg, sh, uniq, reads)
    _remainder_note(report, shuffle)
    return report


def _sample_numbers(table: BlockTable, visits: Visits, seed: int, epoch: int, shuffle: bool) -> Tuple[np.ndarray, ...]:
    """(order position -> dense sample number of this epoch, sorted identities): a repeat made by a weight > 1 is a
    sample of its own (identity = kept number + copy * kept samples)."""
    block, local, copy = items_at(visits, np.arange(visits.total, dtype=np.int64), seed, epoch, shuffle)
    ident = table.first[block] + local + copy * int(table.kept.sum())
    uniq = np.unique(ident)
    return np.searchsorted(uniq, ident), uniq


def block_reads(seg: Segment, sh: LocalShuffle, sample_at: np.ndarray) -> List[Tuple[int, int, np.ndarray, np.ndarray]]:
    """(rank, stretch, micro numbers, samples [k, mbs]) of every reader of a segment."""
    lay = seg.layout
    reads = []
    for rank in range(lay.world_size):
        for v in range(lay.readers_per_rank):
            parts = list(stretch_positions(seg, rank, v, 0, sh))
            pos = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            micros = v + lay.readers_per_rank * np.arange(pos.size // lay.micro_batch_size, dtype=np.int64)
            reads.append((rank, v, micros, sample_at[pos].reshape(-1, lay.micro_batch_size)))
    return reads


def _replay(report: AuditReport, epoch: int, table: BlockTable, visits: Visits, seg: Segment, sh: LocalShuffle,
            uniq: np.ndarray, reads: List[Tuple[int, int, np.ndarray, np.ndarray]]) -> None:
    """Run every reader's own code (stream_reader.read_stretch over a block source that returns sample numbers)
    and compare with the vectorised plan."""
    kept = int(table.kept.sum())

    def read_block(g: int) -> List[Tuple[int, int, int]]:
        return [(0, j, int(table.first[g]) + j) for j in range(int(table.kept[g]))]

    fetch = ItemFetcher(visits, read_block, sh)
    for rank, v, micros, samples in reads:
        got = list(read_stretch(seg, rank, v, 0, sh, fetch))
        ids = np.searchsorted(uniq, [raw + copy * kept for _, items in got for _, _, raw, copy in items])
        if [m for m, _ in got] != micros.tolist() or ids.tolist() != samples.ravel().tolist():
            report.violations.append(f"epoch {epoch} rank {rank} reader {v}: the reader's blocks differ from the plan")


def audit_presharded(counts: Sequence[int], layout: Layout, seed: int, shuffle: bool, buffer: int,
                     epochs: int) -> AuditReport:
    """`data=presharded`: rank r reads part r (`counts[r]` rows) as a world of one; the smallest part sets the steps."""
    report = AuditReport(_header("presharded", f"{len(counts)} parts of {min(counts)}-{max(counts)} rows", layout,
                                 seed, shuffle, buffer if shuffle else 0))
    if len(counts) != layout.world_size:
        report.violations.append(f"{len(counts)} parts for world size {layout.world_size}; re-shard with --parts "
                                 f"{layout.world_size}")
        return report
    part = Layout(1, layout.micro_batch_size, layout.grad_accum, layout.num_workers)
    steps = presharded_steps(list(counts), part)
    bases = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    total = int(sum(counts))
    for epoch in range(epochs):
        shuffler = StreamShuffle(seed, epoch, buffer if shuffle else 0)
        reads = []
        for rank, count in enumerate(counts):
            plan = EpochPlan(count, part, steps=steps)
            sample_of_item = bases[rank] + np.arange(count, dtype=np.int64)
            for _, worker, micros, samples in _stream_reads(plan, shuffler.full_order(count), sample_of_item, 1, part):
                reads.append((rank, worker, micros, samples))
        report.epochs.append(_check_epoch(epoch, total, layout, reads, layout.global_batch, layout.world_size, report))
    if report.epochs and report.epochs[0].not_read >= layout.global_batch:
        report.notes.append("the parts are unbalanced; `dsrecipes shard` writes parts of equal size (+-1)")
    _remainder_note(report, shuffle)
    return report


def _stream_reads(plan: EpochPlan, position_of_item: np.ndarray, sample_of_item: np.ndarray, world: int,
                  layout: Layout) -> List[Tuple[int, int, np.ndarray, np.ndarray]]:
    valid = (position_of_item >= plan.offset) & (position_of_item < plan.end)
    pos = position_of_item[valid]
    samples = sample_of_item[valid]
    sort = np.argsort(pos, kind="stable")
    pos, samples = pos[sort], samples[sort]
    rank, micro, worker = plan.owner(pos)
    reads = []
    mbs = layout.micro_batch_size
    for r in range(world):
        for w in range(layout.readers_per_rank):
            sel = (rank == r) & (worker == w)
            mine = samples[sel]
            micros = np.unique(micro[sel])
            reads.append((r, w, micros, mine.reshape(-1, mbs) if mine.size % mbs == 0 else mine.reshape(1, -1)))
    return reads


def _header(kind: str, what: str, layout: Layout, seed: int, shuffle: bool, buffer: Optional[int] = None) -> str:
    shuf = "on" if shuffle else "off"
    if buffer is not None and shuffle:
        shuf += f" (window {buffer})" if buffer > 1 else " (block order only)"
    return (f"audit data={kind}: {what}; world {layout.world_size} x {layout.readers_per_rank} reader(s) per rank "
            f"(num_workers={layout.num_workers}); micro_batch_size {layout.micro_batch_size} x grad_accum "
            f"{layout.grad_accum} (global batch {layout.global_batch}); seed {seed}; shuffle {shuf}")
