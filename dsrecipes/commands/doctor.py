"""`dsrecipes doctor [overrides] [--json] [--build-ops]`: is this machine able to train, and if not, what to change
(`--build-ops` first builds DeepSpeed's CPU shared-memory op, which the first multi-rank run would build)."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from typing import List

from dsrecipes.commands.args import override_parser, parse


def main(argv: List[str]) -> int:
    from dsrecipes.doctor import Context, Level, Probe, diagnose, render

    parser = override_parser("doctor", "check the environment (torch, CUDA, compilers, shm, caches)")
    parser.add_argument("--json", action="store_true", help="print findings as JSON")
    parser.add_argument("--build-ops", action="store_true",
                        help="JIT-build DeepSpeed's CPU shared-memory op now instead of in the first multi-rank run")
    args = parse(parser, argv)
    if args.build_ops:
        import dsrecipes.shm_op as shm_op

        print(f"building {shm_op.NAME} (1-3 minutes when not cached) ...", file=sys.stderr, flush=True)
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's build log
            print(shm_op.build().describe(), file=sys.stderr)
    ctx = Context()
    try:
        from dsrecipes.config.load import compose_and_load

        ctx = Context.from_config(compose_and_load(args.overrides, check_files=False))
    except Exception as exc:  # noqa: BLE001 - doctor must run even where the config (or hydra) is broken
        print(f"note: could not compose the config ({exc}); checking without it", file=sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import; keep --json clean
        findings = diagnose(Probe(), ctx)
    if args.json:
        print(json.dumps([{**asdict(f), "level": f.level.value} for f in findings], indent=2))
    else:
        print(render(findings))
    return 1 if any(f.level is Level.error for f in findings) else 0
