"""Argument parsing shared by the subcommands: `dsrecipes SUB [key=value ...] [--flags]`.

A usage mistake is a UserError (exit 2, one message), never argparse's own exit.
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn, Sequence

from dsrecipes.errors import UserError
from dsrecipes.suggest import closest, phrase


def override_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser for `dsrecipes SUB [key=value ...] [--flags]`: positional Hydra overrides plus the command's flags."""
    parser = argparse.ArgumentParser(prog=f"dsrecipes {prog}", description=description)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data=iterable zero=stage2")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """argparse, but a usage mistake is a UserError (exit 2, one message naming the closest flags) instead of
    argparse's own usage dump and exit."""
    parser.error = lambda message: usage_error(parser, message)  # type: ignore[method-assign]
    return parser.parse_intermixed_args(list(argv))


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    unknown = re.findall(r"(?<!\w)(--?[\w-]+)", message.partition("unrecognized arguments:")[2])
    hint = "".join(phrase(closest(u, flags)) for u in unknown)
    raise UserError(f"{parser.prog}: {message}{hint} (see {parser.prog} --help)")
