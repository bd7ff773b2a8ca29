"""`data=presharded`: rank r streams only `part_<r>.jsonl` of `data.shard_dir` (written by `dsrecipes shard`).

The part count must equal the world size (otherwise a clear error says how to re-shard). Each rank plans its own part
as a world of one (same slot arithmetic, DataLoader workers split its micro-batches round-robin, windowed shuffle
per epoch), and every rank runs the steps of the *smallest* part: steps = min over parts of count // (mbs x accum).
Remainder: each rank leaves out count_r - steps x mbs x accum samples of its part (the tail of that epoch's order,
so different samples each epoch with shuffling). With the +-1 balanced parts `shard` writes (both balance modes),
the remainders add up to less than one global batch; hand-made uneven parts lose more, and `dsrecipes audit` says so.
Elastic resume is not possible (parts are tied to ranks); another micro batch size or accumulation is.
"""

from __future__ import annotations

from typing import Any

from dsrecipes.config.schema import SourceConfig
from dsrecipes.data.plan import Layout
from dsrecipes.data.sampler import StreamSpec
from dsrecipes.data.strategies.iterable import StreamTrainLoader


class PreshardedTrainLoader(StreamTrainLoader):
    kind = "presharded"


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
        StreamSpec((path,)),
        part_layout(cfg),
        0,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        shuffle_buffer=cfg.data.shuffle_buffer,
        num_samples=manifest.counts[rank],
        make_rows=RowEncoder(cfg, tokenizer, [path], [SourceConfig(name=f"part{rank}")]),
        collate_fn=make_collate(tokenizer),
        num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor,
        part_counts=manifest.counts,
        global_rank=rank,
        fingerprint={"manifest_sha256": manifest.sha256},
    )
