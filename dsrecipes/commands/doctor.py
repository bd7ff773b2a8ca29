"""`dsrecipes doctor [overrides] [--json] [--build-ops]`: is this machine able to train, and if not, what to change
(`--build-ops` first builds the JIT ops the composed config needs, which its first run would build, into the
directory that run uses: jit_ops.build_root)."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from typing import List

import dsrecipes.core.jit_ops as jit_ops
from dsrecipes.commands.args import override_parser, parse
from dsrecipes.core.console import quiet_third_party
from dsrecipes.core.errors import visible
from dsrecipes.run.doctor import Context, Level, Probe, diagnose, render


def main(argv: List[str]) -> int:
    parser = override_parser("doctor", "check the environment (torch, CUDA, compilers, shm, caches)")
    parser.add_argument("--json", action="store_true", help="print findings as JSON")
    parser.add_argument("--build-ops", action="store_true",
                        help="JIT-build the DeepSpeed ops this config needs now instead of in its first run")
    args = parse(parser, argv)
    quiet_third_party(None)  # DeepSpeed's "Setting accelerator to CPU" and the like: the findings say it
    ctx = Context()
    try:
        from dsrecipes.config.load import compose_and_load  # lazy: in the try: doctor runs with a broken Hydra

        ctx = Context.from_config(compose_and_load(args.overrides, check_files=False))
    except Exception as exc:  # noqa: BLE001 - doctor must run even where the config (or hydra) is broken
        print(f"note: could not compose the config ({visible(str(exc))}); checking without it", file=sys.stderr)
    if args.build_ops:
        _build_ops(ctx)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import; keep --json clean
        findings = diagnose(Probe(), ctx)
    if args.json:
        print(json.dumps([{**asdict(f), "level": f.level.value} for f in findings], indent=2))
    else:
        print(render(findings))
    return 1 if any(f.level is Level.error for f in findings) else 0


def _build_ops(ctx) -> None:  # noqa: ANN001 - doctor.Context

    if not ctx.jit_ops:
        print("this config needs no JIT-built op; nothing to build", file=sys.stderr)
    for op in ctx.jit_ops:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's build log
            where = jit_ops.build(op)
        print(f"{op.value}: built ({where})", file=sys.stderr, flush=True)
