"""Typed values for what leaves the process: each `Value` accepts a string or says, in one phrase, what it expected.

Every value a recipe may put on a launcher's command line, into a rank's environment or into a batch script is one
of these (a number, a port, a choice, a name of a strict shape, a list of them); nothing is a free string. The
shapes allow no whitespace, quotes, `$`, `;`, `|` or line breaks, so a checked value means the same thing to a
shell, an argument parser and an `#SBATCH` line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class Value:
    """`check(text)` is None when `text` is acceptable, else what was expected. `flag`: takes no value at all."""

    expected: str
    test: Callable[[str], bool]
    flag: bool = False

    def check(self, text: str) -> Optional[str]:
        return None if self.test(text) else self.expected


def _int(text: str, low: int, high: Optional[int]) -> bool:
    if not re.fullmatch(r"\d{1,12}", text, re.ASCII):  # ASCII digits only (int() also reads '١٢' or '１２')
        return False
    return low <= int(text) and (high is None or int(text) <= high)


def integer(low: int = 0, high: Optional[int] = None) -> Value:
    span = f">= {low}" if high is None else f"in {low}..{high}"
    return Value(f"a whole number {span}", lambda t: _int(t, low, high))


def number(low: float = 0.0) -> Value:
    def test(text: str) -> bool:
        return bool(re.fullmatch(r"\d{1,9}(\.\d{1,9})?", text, re.ASCII)) and float(text) > low

    return Value(f"a number > {low:g}", test)


def choice(*options: str, many: bool = False) -> Value:
    """One of `options` (or, with `many`, a comma-separated list of them)."""

    def test(text: str) -> bool:
        parts = text.split(",") if many else [text]
        return all(p in options for p in parts)

    return Value(("comma-separated values of " if many else "one of ") + ", ".join(options), test)


def shape(pattern: str, expected: str) -> Value:
    """A string matching `pattern` entirely (the patterns below never allow whitespace or shell syntax)."""
    compiled = re.compile(pattern, re.ASCII)  # \d is 0-9 only, never another script's digits
    return Value(expected, lambda t: bool(compiled.fullmatch(t)))


def key_values(keys: Sequence[str], value: Value, sep: str = ",", assign: str = "=") -> Value:
    """`k=v,k=v` with keys from `keys` and every value checked by `value`."""

    def test(text: str) -> bool:
        for part in text.split(sep):
            key, eq, val = part.partition(assign)
            if not eq or key not in keys or value.check(val) is not None:
                return False
        return True

    return Value(f"{sep}-separated KEY{assign}VALUE with KEY one of {', '.join(keys)} and VALUE {value.expected}", test)


FLAG = Value("no value (a flag)", lambda t: False, flag=True)
PORT = integer(1, 65535)
BOOL01 = choice("0", "1")
TRUE_FALSE = choice("true", "false")
NAME = shape(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", "a name of letters, digits, '_', '.', '-'")
HOST = shape(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[?[0-9A-Fa-f:]{2,45}\]?",
             "a host name or IP address")
INTERFACES = shape(r"[\^=]{0,2}[A-Za-z0-9_.:-]{1,64}(?:,[A-Za-z0-9_.:-]{1,64})*",
                   "network interface names, comma-separated (optionally prefixed by ^ or =)")
INT_LIST = shape(r"\d{1,6}(?:,\d{1,6})*", "comma-separated whole numbers")
CORE_LIST = shape(r"\d{1,6}(?:-\d{1,6})?(?:,\d{1,6}(?:-\d{1,6})?)*", "CPU cores such as 0-7,16-23")
SIZE = shape(r"\d{1,12}[KMGT]?", "a size such as 64G")
MODULE_NAME = shape(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}(?:/[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}){0,4}",
                    "an environment-module name such as cuda/12.1 (letters, digits, '_', '.', '+', '-', '/')")
ABS_PATH = shape(r"(?:/[A-Za-z0-9_.+@%,:=~-]{1,255}){1,64}/?",
                 "an absolute path of letters, digits and _.+@%,:=~- (no spaces, quotes or shell characters)")


def path_problem(text: str) -> Optional[str]:
    """ABS_PATH, and no `.` or `..` segment (the path means what it says, wherever it is read)."""
    if ABS_PATH.check(text) is not None:
        return ABS_PATH.expected
    if any(seg in (".", "..") for seg in text.split("/")):
        return "a path without '.' or '..' segments"
    return None
