"""`dsrecipes audit [overrides] --world-size N --num-workers W --epochs E`: prove the data plan before a run.

Without a model or a process group, computes which samples every rank x DataLoader worker reads in each epoch with
the planner the loaders run (`plan.py`: `EpochPlan.owner`, `epoch_order`, `StreamShuffle`, `file_order`), then
checks the guarantees: (1) no sample read twice within an epoch, every sample read except a remainder smaller than
one global batch; (2) the same number of micro-batches and optimizer steps on every rank. Exit 0 when they hold,
1 listing the first violations. For small inputs it also replays each stream reader's own filter
(`sampler.select_slots`) and compares it with the vectorised plan.

Sample counts: `map` uses the prepared train split (tokenized and cached by the data layer, exactly the rows a run
trains on; `--num-rows N` audits a hypothetical size instead); `iterable` counts the JSONL lines of its files (what
the readers count); `presharded` reads the manifest. `--ledger RUN_DIR` checks a finished run's ledger instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.data.plan import EpochPlan, Layout, StreamShuffle, epoch_order, file_order, presharded_steps
from dsrecipes.data.sampler import map_rank_rows, select_slots

REPLAY_LIMIT = 2_000_000  # items x readers up to which stream readers are replayed one by one


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
                 num_samples: Optional[int] = None) -> AuditReport:
    """`data=iterable`: files of `counts` rows read as one shared stream (num_samples: the planned length)."""
    total = int(sum(counts))
    what = f"{len(counts)} files, {total} lines" + ("" if num_samples is None else f", data.num_samples={num_samples}")
    report = AuditReport(_header("iterable", what, layout, seed, shuffle, buffer if shuffle else 0))
    if num_samples is not None and total < num_samples:
        report.violations.append(f"data.num_samples={num_samples} but the files hold {total} lines")
        return report
    if num_samples is not None and total - num_samples >= layout.global_batch:
        report.notes.append(f"data.num_samples={num_samples} is below the {total} lines of the files, so the plan "
                            f"never reaches the last {total - num_samples}; set data.num_samples={total}")
    bases = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    for epoch in range(epochs):
        shuffler = StreamShuffle(seed, epoch, buffer if shuffle else 0)
        order = file_order(len(counts), seed, epoch, shuffle)
        sample_of_item = np.concatenate([bases[f] + np.arange(counts[f], dtype=np.int64) for f in order]) \
            if total else np.zeros(0, dtype=np.int64)
        plan = EpochPlan(total if num_samples is None else num_samples, layout)
        reads = _stream_reads(plan, shuffler.full_order(total), sample_of_item, layout.world_size, layout)
        report.epochs.append(_check_epoch(epoch, total, layout, reads, layout.global_batch, layout.world_size, report))
        if total * layout.num_readers <= REPLAY_LIMIT:
            _replay(report, epoch, sample_of_item, shuffler, layout, plan, reads)
    _remainder_note(report, shuffle)
    return report


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


def _replay(report: AuditReport, epoch: int, sample_of_item: np.ndarray, shuffler: StreamShuffle, layout: Layout,
            plan: EpochPlan, reads: List[Tuple[int, int, np.ndarray, np.ndarray]]) -> None:
    """Run every reader's own stream filter and compare with the vectorised plan."""
    steps = plan.steps
    for rank, worker, micros, samples in reads:
        got = list(select_slots(sample_of_item.tolist(), shuffler, layout, rank, worker, steps=steps))
        got_micros = [m for m, _ in got]
        got_samples = [s for _, items in got for s in items]
        if got_micros != micros.tolist() or got_samples != samples.ravel().tolist():
            report.violations.append(f"epoch {epoch} rank {rank} worker {worker}: the reader's filter differs from the plan")


def _header(kind: str, what: str, layout: Layout, seed: int, shuffle: bool, buffer: Optional[int] = None) -> str:
    shuf = "on" if shuffle else "off"
    if buffer is not None and shuffle:
        shuf += f" (window {buffer})" if buffer > 1 else " (files only)"
    return (f"audit data={kind}: {what}; world {layout.world_size} x {layout.readers_per_rank} reader(s) per rank "
            f"(num_workers={layout.num_workers}); micro_batch_size {layout.micro_batch_size} x grad_accum "
            f"{layout.grad_accum} (global batch {layout.global_batch}); seed {seed}; shuffle {shuf}")


# ---------------------------------------------------------------------------------------------------------------
# Command


def audit_config(cfg: Any, world_size: int, epochs: int, num_rows: Optional[int] = None) -> AuditReport:
    from dsrecipes.config.schema import DataKind

    layout = Layout.from_cfg(cfg, world_size)
    seed, shuffle, buffer = cfg.trainer.seed, cfg.data.shuffle, cfg.data.shuffle_buffer
    if cfg.data.kind is DataKind.presharded:
        from dsrecipes.data.shard import read_manifest

        return audit_presharded(read_manifest(cfg.data.shard_dir).counts, layout, seed, shuffle, buffer, epochs)
    if cfg.data.kind is DataKind.iterable:
        from dsrecipes.data.sampler import stream_spec

        stream, _ = stream_spec(cfg)
        return audit_stream(stream.counts(), layout, seed, shuffle, buffer, epochs, cfg.data.num_samples)
    if num_rows is None:
        num_rows = prepared_rows(cfg)
    return audit_map(num_rows, layout, seed, shuffle, epochs)




def prepared_rows(cfg: Any) -> int:
    """Rows of the prepared train split (the data layer's cache makes a second call cheap)."""
    import tempfile

    from dsrecipes.data.prepare import prepare
    from dsrecipes.model import load_tokenizer

    with tempfile.TemporaryDirectory(prefix="dsrecipes-audit-") as run_dir:
        return len(prepare(cfg, load_tokenizer(cfg), run_dir).train)

