"""`dsrecipes estimate [overrides] [--gpus-per-node N] [--nodes M] [--gpu-mem-gb G]`: memory per GPU/CPU."""

from __future__ import annotations

import json
import sys
from typing import List

from dsrecipes.commands.args import existing_path, override_parser, parse, positive_float, positive_int
from dsrecipes.config.defaults import with_derived_defaults
from dsrecipes.config.load import compose_and_load
from dsrecipes.core.topology import resolve_topology
from dsrecipes.run.estimate import estimate, render
from dsrecipes.run.micro_batch import needs_number


def main(argv: List[str]) -> int:
    parser = override_parser("estimate", "memory per GPU/CPU for every ZeRO stage and offload choice")
    parser.add_argument("--gpus-per-node", type=positive_int, default=None,
                        help="default: the launcher's ranks per node")
    parser.add_argument("--nodes", type=positive_int, default=None, help="default: the launcher's nodes")
    parser.add_argument("--gpu-mem-gb", type=positive_float, default=None,
                        help="GPU memory (GiB) to check each option against")
    parser.add_argument("--hf-config", type=existing_path, default=None,
                        help="a config.json (or its directory) when model.path is absent")
    parser.add_argument("--json", action="store_true")
    args = parse(parser, argv)
    cfg = with_derived_defaults(compose_and_load(args.overrides, check_files=False))  # the model's own name
    needs_number(cfg, "estimate")
    topo = resolve_topology(cfg.launcher)
    gpus = args.gpus_per_node if args.gpus_per_node is not None else topo.per_node
    nodes = args.nodes if args.nodes is not None else topo.num_nodes
    result = estimate(cfg, gpus, nodes, args.gpu_mem_gb, args.hf_config)
    print(json.dumps(result, indent=2) if args.json else render(cfg, result))
    sys.stdout.flush()
    return 0
