"""Not a test module: a stand-in for `dsrecipes.rank.worker` that the launcher tests start on every rank.

`python -m test_launch_probe --run-dir RUN` (with tests/ on PYTHONPATH) checks the env:// variables the launchers
must provide, does one all_reduce over gloo, and writes `RUN/probe/rank<R>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)  # strict: a stray --local_rank would fail here
    import torch
    import torch.distributed as dist

    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["NCCL_IB_TIMEOUT"] = os.environ.get("NCCL_IB_TIMEOUT")  # set through launcher.env by the tests
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    out = Path(args.run_dir) / "probe"
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "world_size": world, "sum": t.item(), "env": env, "argv": sys.argv[1:]}
    (out / f"rank{rank}.json").write_text(json.dumps(record), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
