"""`dsrecipes inspect-data [overrides] --rows K`: prepared rows with trained tokens highlighted, plus statistics."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import List

from dsrecipes.commands.args import override_parser, parse
from dsrecipes.config.load import compose_and_load
from dsrecipes.data.inspect import format_stats, render_row


def main(argv: List[str]) -> int:
    from dsrecipes.data.prepare import prepare  # lazy: else `commands.inspect_data` imports numpy 0.11 s
    from dsrecipes.model import load_tokenizer  # lazy: else `commands.inspect_data` imports torch 3.80 s

    parser = override_parser("inspect-data", "render prepared samples with trained tokens highlighted, plus statistics")
    parser.add_argument("--rows", type=int, default=3, help="rows to render (default 3)")
    parser.add_argument("--split", choices=["train", "val"], default="train")
    parser.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    parser.add_argument("--run-dir", default=None, help="where prepare_stats.json/quarantine.jsonl go (default: temp dir)")
    args = parse(parser, argv)
    cfg = compose_and_load(args.overrides)
    tokenizer = load_tokenizer(cfg)
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="dsrecipes-inspect-")
    try:
        prepared = prepare(cfg, tokenizer, run_dir)
    except BaseException:
        if not args.run_dir:
            _remove_if_empty(run_dir)  # ours, and nothing in it to read: no empty directory left behind
        raise
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    split = prepared.train if args.split == "train" else prepared.val
    if split is None:
        print(f"(no {args.split} split: dataset.val_size=0)")
    else:
        for r in range(min(args.rows, len(split))):
            print(render_row(split[r], tokenizer, color, title=f"{args.split} row {r}"))
    print(format_stats(prepared.stats))
    print(f"stats: {run_dir}/prepare_stats.json")
    return 0


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)  # fails (and keeps it) when prepare wrote anything there, e.g. a quarantine file
    except OSError:
        pass
