"""`dsrecipes node RUN_DIR --node-rank N [--wait-s S]`: node N (> 0) of a multi-node run without ssh
(launcher=deepspeed_multinode or torchrun; launch/multinode_nossh.sh runs it on every node but node 0). Waits for
node 0 to write this attempt's run directory, then starts this node's ranks from the run's config, supervised as on
node 0 (dsrecipes/run/join.py)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List

from dsrecipes.commands.args import non_negative_float, non_negative_int, parse
from dsrecipes.run.join import join

WAIT_S = 1800.0  # launch/multinode_nossh.sh's WAIT_S: node 0 may prepare (tokenize) the data first


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="dsrecipes node",
        description="Join a multi-node run without ssh as node N > 0: wait for node 0 (NODE_RANK=0 of "
        "launch/multinode_nossh.sh) to write RUN_DIR, then start and supervise this node's ranks, built from the "
        "run's config (launch.txt is only a record).",
    )
    parser.add_argument("run_dir", help="the run directory node 0 writes (RUN_DIR; shared storage, same path)")
    parser.add_argument("--node-rank", type=non_negative_int, required=True, help="this node's rank (1..NNODES-1)")
    parser.add_argument("--wait-s", type=non_negative_float, default=WAIT_S,
                        help=f"how long to wait for node 0 (default {WAIT_S:g} s)")
    args = parse(parser, argv)
    return join(Path(args.run_dir), args.node_rank, args.wait_s)
