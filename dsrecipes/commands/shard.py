"""`dsrecipes shard [INPUT...] --parts N --out DIR [--balance samples|tokens] [--val-size N] [overrides]`: one JSONL part per rank."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import List, Sequence

from dsrecipes.commands.args import non_negative_float, override_parser, parse
from dsrecipes.config.load import compose_and_load
from dsrecipes.core.schema import ShardBalance
from dsrecipes.data.shard.build import shard
from dsrecipes.observe.report import absolute_override


def main(argv: List[str]) -> int:
    parser = override_parser("shard", "split data into one JSONL part per rank (+ manifest.json)")
    parser.add_argument("--parts", type=int, required=True, help="number of parts = the world size that will read them")
    parser.add_argument("--out", required=True, help="output directory (becomes data.shard_dir)")
    parser.add_argument("--balance", choices=[b.value for b in ShardBalance], default=ShardBalance.samples.value,
                        help="samples: equal counts; tokens: equal counts and even token totals")
    parser.add_argument("--force", action="store_true",
                        help="replace the shard already in --out (only the files its manifest lists)")
    parser.add_argument("--val-size", type=non_negative_float, default=0, metavar="N",
                        help="hold N samples (a count, or a fraction < 1) out into the validation part val.jsonl")
    args = parse(parser, argv)
    inputs = [p if "://" in p else os.path.abspath(p) for p in args.overrides if "=" not in p]
    overrides = [a for a in args.overrides if "=" in a]
    # what writes these parts again, recorded in the manifest: a changed part is refused with it (manifest.py)
    shard_args = [*inputs, "--parts", str(args.parts), "--balance", args.balance, *held_out(args.val_size),
                  *map(absolute_override, overrides)]  # local paths absolute: the command works from anywhere
    if inputs:  # INPUT files replace the dataset's own sources; format/columns still come from `dataset`
        overrides += ["dataset.paths=[" + ",".join(json.dumps(p) for p in inputs) + "]",
                      "dataset.sources=[]", "dataset.use=[]"]
    cfg = compose_and_load(overrides, check_files=True)
    manifest = shard(cfg, args.parts, args.out, ShardBalance(args.balance), args.force, args.val_size, shard_args)
    val = f", validation part of {manifest.val_count}" if manifest.val_file else ""
    print(f"wrote {manifest.parts} parts of {min(manifest.counts)}-{max(manifest.counts)} samples "
          f"({manifest.total} in all, balance={manifest.balance}{val}) to {args.out}")
    if manifest.bad_rows:
        print(f"skipped bad rows: {manifest.bad_rows} (see {inside(args.out, 'quarantine.jsonl')})")
    print(f"train with: {training_command(args.out, manifest.parts, overrides)}")
    if manifest.parts > 1:
        print(f"on M nodes x G ranks (M x G = {manifest.parts}): replace the launcher part with "
              "launcher=deepspeed_multinode launcher.num_nodes=M launcher.num_gpus=G launcher.master_addr=NODE0 "
              "(walkthrough: launch/README.md)")
    return 0


def held_out(val_size: float) -> List[str]:
    """`--val-size` as it was given (a count without `.0`), or nothing for none."""
    if not val_size:
        return []
    return ["--val-size", str(int(val_size)) if val_size == int(val_size) else repr(val_size)]


def inside(out_dir: str, name: str) -> str:
    """`name` in the output: a store prefix joined as a URL (`Path` would print `s3:/bucket/...`)."""
    return f"{out_dir.rstrip('/')}/{name}" if "://" in out_dir else str(Path(out_dir) / name)


# Overrides that only described the input or would clash with the printed launcher/data settings.
_NOT_CARRIED = ("dataset", "data=", "data.kind", "data.shard_dir", "launcher")


def training_command(out_dir: str, parts: int, overrides: Sequence[str]) -> str:
    """The command that trains on the parts, as it must be typed: one rank per part on this machine, plus the
    user's overrides that shape training (model, template, cutoff, trainer, ...), so token balance matches."""
    carried = [absolute_override(o) for o in overrides if not o.lstrip("+~").startswith(_NOT_CARRIED)]
    shard_dir = out_dir if "://" in out_dir else os.path.abspath(out_dir)  # a store prefix is kept as written
    argv = ["python", "-m", "dsrecipes", "data=presharded", f"data.shard_dir={shard_dir}",
            "launcher=deepspeed", f"launcher.num_gpus={parts}", *carried]  # fmt: skip
    if "objective=dpo" in carried and not any(o.startswith("objective.reference=") for o in carried):
        argv.append("objective.reference=live")  # parts carry no reference log-probs (README: DPO)
    return shlex.join(argv)
