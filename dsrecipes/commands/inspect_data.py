"""`dsrecipes inspect-data [overrides] --rows K`: prepared rows with trained tokens highlighted, plus statistics.

The statistics (prepare_stats.json, quarantine.jsonl) go to a temporary directory removed before it returns, or to
`--run-dir DIR` (kept): a new or empty directory (made ours by INSPECT_MARKER) or one an earlier inspect-data made. Anything else (a file, a
user's directory, a training run's directory, whose files the run reads) is refused before any work, nothing touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, List, Tuple

from dsrecipes.commands.args import non_negative_int, override_parser, parse
from dsrecipes.config.load import compose_and_load
from dsrecipes.core.fileio import remove_empty_dirs
from dsrecipes.core.rundir import CONFIG_FILE, MARKER_FILE, claim_marked_dir
from dsrecipes.core.tokenizer import load_tokenizer
from dsrecipes.data.render.inspect import format_stats, render_row
from dsrecipes.data.render.parity import split_report
from dsrecipes.data.render.serving import run_template

INSPECT_MARKER = "dsrecipes_inspect.json"  # a directory inspect-data made: it may write there again
KEY = "--run-dir"


def main(argv: List[str]) -> int:
    parser = override_parser("inspect-data", "render prepared samples with trained tokens highlighted, plus statistics")
    parser.add_argument("--rows", type=non_negative_int, default=3, help="rows to render (default 3)")
    parser.add_argument("--split", choices=["train", "val"], default="train")
    parser.add_argument("--color", choices=["auto", "always", "never"], default="auto")
    parser.add_argument("--run-dir", default=None, help="where prepare_stats.json/quarantine.jsonl go: a new or empty "
                                                        "directory, or one inspect-data wrote (default: temp dir)")
    args = parse(parser, argv)
    if args.run_dir:
        return _inspect(args, *claim_inspect_dir(Path(args.run_dir)))
    run_dir = Path(tempfile.mkdtemp(prefix="dsrecipes-inspect-"))
    code = _inspect(args, run_dir, [run_dir])  # a failure leaves only a quarantine file to read (_take_back)
    shutil.rmtree(run_dir, ignore_errors=True)  # ours, made above: nothing left behind per call
    return code


def _inspect(args: Any, run_dir: Path, created: List[Path]) -> int:
    from dsrecipes.data.prepare.build import prepare  # lazy: else `commands.inspect_data` imports numpy 0.11 s

    try:
        cfg = compose_and_load(args.overrides)
        tokenizer = load_tokenizer(cfg)
        prepared = prepare(cfg, tokenizer, run_dir)
    except BaseException:
        _take_back(created)  # nothing in it to read: no empty directory left behind
        raise
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    split = prepared.train if args.split == "train" else prepared.val
    if split is None:
        print(f"(no {args.split} split: dataset.val_size=0)")
    else:
        for r in range(min(args.rows, len(split))):
            print(render_row(split[r], tokenizer, color, title=f"{args.split} row {r}"))
    print(format_stats(prepared.stats))
    if split is not None:
        rows = (split[r] for r in range(len(split)))
        print(f"template {run_template(cfg, tokenizer).name.value}: {split_report(rows, tokenizer)}")
    if args.run_dir:
        print(f"stats: {run_dir}/prepare_stats.json")
    return 0


def claim_inspect_dir(run_dir: Path) -> Tuple[Path, List[Path]]:
    """`--run-dir` made ours (rundir.claim_marked_dir), never a training run's directory. Returns it and what this
    call created (the marker, the directories: deepest first)."""
    run_dir = run_dir.expanduser()
    why = "is a training run's directory ({}), whose files the run reads; inspect-data never writes there"
    made = claim_marked_dir(run_dir, KEY, INSPECT_MARKER, "a directory inspect-data wrote",
                            refused={name: why.format(name) for name in (MARKER_FILE, CONFIG_FILE)})
    return run_dir, made


def _take_back(created: List[Path]) -> None:
    """After a failure, remove what this inspect-data created (its marker, then its directories) while nothing else
    was written beside it: a quarantine file stays, to be read, in a directory still marked ours."""
    files = [p for p in created if not p.is_dir()]
    for path in files:
        with contextlib.suppress(OSError):
            if os.listdir(path.parent) == [path.name]:
                path.unlink()
    remove_empty_dirs([p for p in created if p not in files])
