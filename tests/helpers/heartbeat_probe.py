"""Not a test module: one rank of a 2-rank gloo job with dsrecipes' heartbeat, for tests/test_heartbeat.py.

`python -m tests.helpers.heartbeat_probe RUN_DIR TIMEOUT_S [finish]` with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/
MASTER_PORT set: joins the group, starts the heartbeat, writes RUN_DIR/ready<rank>, then rank 0 waits in an all_reduce
for rank 1, which sleeps (the test kills or freezes one of them). A crash goes through `heartbeat.explain_crash`, as
in the worker. With `finish`: both stop their heartbeat as train() does at the end, rank 1 exits at once and rank 0
only after the timeout and then some (ranks that finish at different times are not taken for dead).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path


def main(run_dir: str, timeout_s: str, mode: str = "") -> int:
    import torch
    import torch.distributed as dist

    from dsrecipes.core import heartbeat

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    heartbeat.start(Path(run_dir), rank, dist.get_world_size(), int(timeout_s))
    (Path(run_dir) / f"ready{rank}").touch()
    if mode == "finish":
        heartbeat.stop()
        time.sleep(0 if rank == 1 else int(timeout_s) + 3)
        return 0
    try:
        if rank == 1:
            time.sleep(600)
        dist.all_reduce(torch.ones(1))
    except Exception:
        heartbeat.explain_crash()
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
