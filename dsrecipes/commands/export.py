"""`dsrecipes export RUN_DIR [--tag T] --out DIR [--lora merged|adapter]`: a Hugging Face model from a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from dsrecipes.boundary.checkpoint_find import latest_complete
from dsrecipes.boundary.trust import FLAG, TRUST_HELP, trust
from dsrecipes.commands.args import parse
from dsrecipes.config.lf_translate import lf_command_file
from dsrecipes.core.checkpoint_names import CHECKPOINTS, COMPLETE
from dsrecipes.core.errors import UserError
from dsrecipes.core.export_dir import remove_stale_staging
from dsrecipes.core.fileio import dangling_link_problem


def main(argv: List[str]) -> int:
    from dsrecipes.rank.export import (  # lazy: else `commands.export` imports torch 3.80 s, numpy 0.11 s
        check_out_dir,
        export_checkpoint,
    )

    parser = argparse.ArgumentParser(
        prog="dsrecipes export",
        description="Write a Hugging Face model directory (safetensors, config, tokenizer) from a run's checkpoint.")
    parser.add_argument("run_dir", help="a run directory (holds config.yaml and checkpoints/), or one of its "
                        "checkpoints (RUN/checkpoints/step_N: the same as RUN --tag step_N)")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. step_100 (default: the newest complete)")
    parser.add_argument("--out", required=True, help="directory to write the Hugging Face model to: new, empty, or an "
                        "earlier export (replaced); anything else is refused")
    parser.add_argument("--lora", choices=["merged", "adapter"], default=None,  # an argparse choice, not config
                        help="LoRA runs: merged model or adapter only (default: trainer.export_merged_lora)")
    parser.add_argument(FLAG, action="append", default=[], metavar="PATH", help=TRUST_HELP)
    lf_file = next((hint for a in argv if not a.startswith("-") for hint in [lf_command_file(a, "export")] if hint), None)
    if lf_file:  # `llamafactory-cli export merge.yaml`: before argparse asks for --out
        raise UserError(lf_file)
    args = parse(parser, argv)
    trust(args.trust_checkpoint)
    run_dir, tag = run_and_tag(Path(args.run_dir), args.tag)
    link = dangling_link_problem("--out", args.out)  # resolve() would name the missing target, and export make it
    if link:
        raise UserError(link)
    out_dir = Path(args.out).expanduser().resolve()
    check_out_dir(out_dir, "--out")  # before any work
    root = run_dir / CHECKPOINTS
    retry = f"dsrecipes export {run_dir} --out {args.out}"
    tag_dir = root / tag if tag else latest_complete(root, retry=retry)
    if tag_dir is None or not tag_dir.is_dir():
        raise UserError(f"{root}: no complete checkpoint{' ' + tag if tag else ''} to export" + tags_note(root))
    for stale in remove_stale_staging(out_dir):  # (a refused export above changes nothing)
        print(f"removed {stale}: what an earlier export to {out_dir}, killed mid-write, left", file=sys.stderr)
    merge = None if args.lora is None else args.lora == "merged"
    out = export_checkpoint(run_dir, tag_dir, out_dir, merge_lora=merge, key="--out", retry=retry)
    print(f"exported {tag_dir} -> {out}")
    return 0


def run_and_tag(path: Path, tag: Optional[str]) -> Tuple[Path, Optional[str]]:
    """(run directory, tag). A checkpoint directory of a run (`RUN/checkpoints/step_350`) is taken as
    `RUN --tag step_350`, the way a user who sees that folder names it; any other path is a run directory."""
    if path.parent.name != CHECKPOINTS or not (path.parent.parent / "config.yaml").is_file():
        return path, tag
    if tag is not None and tag != path.name:
        raise UserError(f"export: {path} is the checkpoint {path.name} of the run {path.parent.parent}, but --tag "
                        f"names {tag}; give the run directory with --tag, or the checkpoint directory alone")
    return path.parent.parent, path.name


def tags_note(root: Path) -> str:
    """`; its checkpoints: step_4, step_8 (export one with --tag)`, or why there are none."""
    if not root.is_dir():
        return f" ({root.parent} is not a run directory: it has no {CHECKPOINTS}/ folder)"
    tags = sorted((d.name for d in root.iterdir() if (d / COMPLETE).is_file()), key=lambda t: (len(t), t))
    return f"; its complete checkpoints: {', '.join(tags)} (choose one with --tag)" if tags else ""
