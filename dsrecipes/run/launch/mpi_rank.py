"""`python -m dsrecipes.run.launch.mpi_rank ...`: what each mpirun rank runs before the worker module."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Sequence

from dsrecipes.run.launch.plan import WORKER_MODULE


def main(argv: Sequence[str]) -> int:
    """What each mpirun rank runs before the worker module.

    DeepSpeed's own mpi4py discovery (rank, world size, local rank, master address from rank 0) fills RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, with our port instead of its fixed 29500, so that
    `deepspeed.init_distributed()` in the worker finds a complete env:// setup.
    """

    parser = argparse.ArgumentParser(prog="python -m dsrecipes.run.launch.mpi_rank")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--master-addr", default=None, help="default: rank 0's address (hostname -I)")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE exported before the worker starts")
    parser.add_argument("--module", default=WORKER_MODULE)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(list(argv))
    try:
        from deepspeed.comm.comm import mpi_discovery
    except ImportError as exc:
        print(f"error: launcher=mpirun needs mpi4py and deepspeed in this environment ({exc})", file=sys.stderr)
        return 2
    mpi_discovery(distributed_port=args.master_port, verbose=False)
    if args.master_addr:
        os.environ["MASTER_ADDR"] = args.master_addr
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
