"""Argument parsing shared by the subcommands: `dsrecipes SUB [key=value ...] [--flags]`.

A usage mistake is a UserError (exit 2, one message), never argparse's own exit.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from dsrecipes.errors import UserError


def override_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser for `dsrecipes SUB [key=value ...] [--flags]`: positional Hydra overrides plus the command's flags."""
    parser = argparse.ArgumentParser(prog=f"dsrecipes {prog}", description=description)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data=iterable zero=stage2")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """argparse, but a usage mistake is a UserError (exit 2, one message) instead of argparse's own exit."""
    try:
        return parser.parse_intermixed_args(list(argv))
    except SystemExit as exc:
        if exc.code == 0:
            raise
        raise UserError(f"bad arguments for `{parser.prog}` (see --help)") from None
