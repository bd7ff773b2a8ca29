"""The launching process's part of a run, for tests that build rank loaders directly: prepare, index or check the
data and write the run directory (config.yaml, plan.json, ds_config.json) exactly as `python -m dsrecipes` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plan_like_launcher(cfg: Any, run_dir: Path, world_size: int) -> Any:
    """The RunPlan `entry.write_run_dir` writes for `cfg` in `run_dir` with `world_size` ranks on one node."""
    from dsrecipes.core.topology import Topology
    from dsrecipes.run.entry import with_run_dir, write_run_dir

    return write_run_dir(with_run_dir(cfg, Path(run_dir)), Topology(world_size, 1, world_size))


def stream_index_like_launcher(paths: Any, run_dir: Path, block_bytes: Any = None, world_size: int = 1,
                               weights: Any = None, chunk_bytes: Any = None) -> Any:
    """The StreamIndex a rank opens after `python -m dsrecipes data=iterable` indexed `paths` into `run_dir`: written
    by the launching process, then read and checked as a rank does. Any JSONL lines, empty files too (no prescan,
    bad_rows=skip), all of them trained (no hold-out, no cap, a global batch of one); `weights`: one source per file
    with these mixing weights; `chunk_bytes`: data.chunk_bytes (None: automatic)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.strategies.iterable import IterableStrategy

    paths = [str(p) for p in paths]
    data = [f"dataset.paths=[{','.join(paths)}]"] if weights is None else ["dataset.paths=[]", "dataset.sources=[" + ",".join(
        f"{{name: s{i}, paths: [{p}], weight: {w}}}" for i, (p, w) in enumerate(zip(paths, weights))) + "]"]
    cfg = compose_and_load(["data=iterable", "data.prescan=false", "dataset.bad_rows=skip", "dataset.val_size=0",
                            "dataset.max_samples=null", "trainer.micro_batch_size=1", "trainer.max_steps=1", *data,
                            f"data.block_bytes={block_bytes or 'null'}", f"data.chunk_bytes={chunk_bytes or 'null'}",
                            f"data.cache_dir={run_dir}-cache"])
    plan = plan_like_launcher(cfg, run_dir, world_size)
    return IterableStrategy().open(cfg, str(run_dir), 0, world_size, plan)
