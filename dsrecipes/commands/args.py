"""Argument parsing shared by the subcommands: `dsrecipes SUB [key=value ...] [--flags]`.

A usage mistake is a UserError (exit 2, one message), never argparse's own exit. A flag value that makes no sense
(`--world-size 0`, `--max-new-tokens -3`, a path that is not there) is refused here, by the flag's type, never
replaced by a default: `positive_int`, `bounded_int`, `non_negative_int`, `positive_float`, `non_negative_float`,
`existing_path`, `existing_dir`; an empty value (`--out "$DIR"` with DIR unset) for every flag but chat's free text.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any, Callable, NoReturn, Sequence

from dsrecipes.config.foreign_keys import FROM_OTHER_TOOLS
from dsrecipes.core.errors import UserError
from dsrecipes.core.suggest import closest, phrase

MAX_NEW_TOKENS = 32768  # chat, prompt-eval: past any context we train; more is minutes of generation
TEXT_FLAGS = ("message", "system")  # chat: free text, where an empty value means "none"
TRAIN_PROG = "dsrecipes train"  # Hydra's parser (the training command's) names itself after sys.argv[0]


def command_parser(prog: str, description: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A parser for `dsrecipes SUB ...`, named so in its usage and errors (never `__main__.py` under `python -m`)."""
    return argparse.ArgumentParser(prog=f"dsrecipes {prog}", description=description, **kwargs)


def override_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser for `dsrecipes SUB [key=value ...] [--flags]`: positional Hydra overrides plus the command's flags."""
    parser = command_parser(prog, description)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data=iterable zero=stage2")
    return parser


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: `convert(text)` when that works and `ok` holds, else argparse's error (exit 2 through
    `parse`, naming the flag): `argument --world-size: must be a positive integer, got '0'`."""

    def check(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return check


positive_int = _checked(int, lambda v: v > 0, "a positive integer")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
non_negative_float = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")


def bounded_int(high: int, why: str) -> Callable[[str], Any]:
    """A positive integer up to `high` (a flag whose work grows with its value: one message, never minutes of
    silence): `argument --world-size: must be a positive integer up to 16384 (audit simulates every rank), got ...`."""
    return _checked(int, lambda v: 0 < v <= high, f"a positive integer up to {high} ({why})")


existing_path = _checked(lambda p: p if os.path.exists(os.path.expanduser(p)) else None, bool, "an existing path")
existing_dir = _checked(lambda p: p if os.path.isdir(os.path.expanduser(p)) else None, bool, "an existing directory")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """argparse, but a usage mistake is a UserError (exit 2, one message naming the closest flags) instead of
    argparse's own usage dump and exit."""
    if not parser.prog.startswith("dsrecipes "):  # Hydra's parser: `__main__.py` under `python -m dsrecipes`
        parser.prog = TRAIN_PROG
    parser.error = lambda message: usage_error(parser, message)  # type: ignore[method-assign]
    parser.allow_abbrev = False  # `--config x.yaml` is not Hydra's --config-name/-path/-dir cut short
    args = parser.parse_intermixed_args(list(argv))
    for action in parser._actions:  # `--out "$DIR"` with DIR unset: never "the default" or the working directory
        value = getattr(args, action.dest, None)
        if action.option_strings and action.dest not in TEXT_FLAGS and (value == "" or
                                                                         (isinstance(value, list) and "" in value)):
            raise UserError(f"{parser.prog}: {action.option_strings[-1]}: empty (an unset shell variable?); give a "
                            f"value or leave the flag out (see {parser.prog} --help)")
    return args


RECIPE_FILE_HINT = "; a recipe file is given by its path: dsrecipes train FILE.yaml (or recipe=FILE.yaml)"


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    unknown = re.findall(r"(?<!\w)(--?[\w-]+)", message.partition("unrecognized arguments:")[2])
    hint = "".join(_foreign_flag(u) or phrase(closest(u, flags)) for u in unknown)
    if re.search(r"argument --cfg/-c: invalid choice: '[^']*\.ya?ml'", message):  # `-c my.yaml`: Hydra's --cfg
        hint = RECIPE_FILE_HINT
    raise UserError(f"{parser.prog}: {message}{hint} (see {parser.prog} --help)")


def _foreign_flag(flag: str) -> str:
    """The hint for another tool's flag: `--config FILE` (LLaMA-Factory, TRL, axolotl), `--learning_rate 1e-4`
    (HF TrainingArguments: our key, as an override)."""
    if flag in ("--config", "--config_file", "--config-file"):
        return RECIPE_FILE_HINT
    ours = FROM_OTHER_TOOLS.get(flag.lstrip("-").replace("-", "_"))
    return f"; {flag} is another tool's flag: here the override {ours}=VALUE" if flag.startswith("--") and ours else ""
