"""The launching process's part of a run, for tests that build rank loaders directly: prepare, index or check the
data and write the run directory (config.yaml, plan.json, ds_config.json) exactly as `python -m dsrecipes` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plan_like_launcher(cfg: Any, run_dir: Path, world_size: int) -> Any:
    """The RunPlan `entry.write_run_dir` writes for `cfg` in `run_dir` with `world_size` ranks on one node."""
    from dsrecipes.entry import with_run_dir, write_run_dir
    from dsrecipes.topology import Topology

    return write_run_dir(with_run_dir(cfg, Path(run_dir)), Topology(world_size, 1, world_size))
