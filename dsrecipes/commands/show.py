"""`dsrecipes show [overrides] [--world-size N] [--total-steps N]`: the resolved config and its DeepSpeed JSON."""

from __future__ import annotations

import json
from typing import List

import yaml

from dsrecipes.commands.args import override_parser, parse
from dsrecipes.config.load import compose_and_load, config_to_dict
from dsrecipes.config.schema import SchedulerKind
from dsrecipes.ds_config import build_ds_config
from dsrecipes.topology import resolve_topology


def main(argv: List[str]) -> int:
    parser = override_parser("show", "Print the resolved config and the DeepSpeed JSON for a world size.")
    parser.add_argument("--world-size", type=int, default=None, help="data-parallel ranks (default: the launcher's)")
    parser.add_argument("--total-steps", type=int, default=None,
                        help="optimizer steps of the run, for decaying schedulers in epoch-based runs")
    parser.add_argument("--json-only", action="store_true", help="print only the DeepSpeed JSON")
    args = parse(parser, argv)
    cfg = compose_and_load(args.overrides, check_files=False)
    world = args.world_size or resolve_topology(cfg.launcher).world_size
    total = args.total_steps if args.total_steps is not None else cfg.trainer.max_steps
    if not args.json_only:
        print("# resolved config")
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True))
        print(f"# DeepSpeed JSON at world size {world}")
    if total is None and cfg.scheduler.name is not SchedulerKind.constant:
        # Epoch-based: the launcher computes the step count from the data plan before writing ds_config.json.
        print("# (trainer.max_steps is null: total_num_steps comes from the data plan at launch; "
              "pass --total-steps N to preview)")
        total = 1
    print(json.dumps(build_ds_config(cfg, world, total), indent=2))
    return 0
