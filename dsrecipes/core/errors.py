"""User-facing errors: one clear message, exit code 2, never a traceback."""

from __future__ import annotations

import contextlib
import unicodedata
from typing import Iterable, Iterator, List


class UserError(Exception):
    """A mistake the user can fix (config, data, environment). Printed without a traceback."""

    exit_code = 2

    def __init__(self, problems: Iterable[str] | str, footer: str = ""):
        self.problems: List[str] = [problems] if isinstance(problems, str) else list(problems)
        self.footer = footer  # printed under the problems (render), not one of them: what to write instead
        super().__init__("\n".join(self.problems))

    def render(self) -> str:
        """The message for the terminal: a problem quoting someone else's file (a recipe's key, a row) shows its
        control characters escaped (`\\x1b`), never as terminal sequences (title, clipboard, cursor)."""
        problems = [visible(p) for p in self.problems]
        footer = f"\n{visible(self.footer).rstrip()}" if self.footer else ""
        if len(problems) == 1:
            return f"error: {problems[0]}{footer}"
        lines = [f"error: {len(problems)} problems:"]
        lines += [f"  - {p}" for p in problems]
        return "\n".join(lines) + footer


def visible(text: str) -> str:
    """`text` safe to print on a terminal: what is invisible or a terminal acts on (ESC, BEL, C1 controls, bidi
    overrides, line separators) shown escaped (`\\x1b`, `\\u202e`); newline, tab, every space and the zero-width
    joiners (emoji sequences, Persian text) kept. The one escaper for console text quoting a file or a model."""
    return "".join(c if c.isprintable() or c in _KEPT or unicodedata.category(c) == "Zs" else repr(c)[1:-1]
                   for c in str(text))


_KEPT = "\n\t\u200c\u200d"


class ConfigError(UserError):
    """The composed configuration is invalid (unknown key, bad type, broken rule)."""


class DataError(UserError):
    """Input data is malformed; messages name `file:line`."""


class RunInterrupted(Exception):
    """The ranks stopped on SIGTERM/SIGINT at a step boundary (after saving a checkpoint when there was time)."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"interrupted by signal {signum} at step {step}")
        self.exit_code = 128 + int(signum)
        self.step = step


class TrainingFailed(Exception):
    """Training cannot succeed (a non-finite loss): exit 1, and nothing is checkpointed or exported after it."""

    exit_code = 1

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class Refused(UserError):
    """A run that would lose or mix work in its run directory (a resume the checkpoint cannot take, a restart over a
    run, no trustworthy checkpoint): refused before anything is written there, not even result.json."""


class NothingToTrain(Refused):
    """A resume of a finished run that would train no step (the same budget again). A sweep's job that meets it is
    a job done earlier: reported as skipped, not as a failure (commands/train.py)."""


@contextlib.contextmanager
def no_custom_code(key: str, path: str) -> Iterator[None]:
    """Around a transformers load with trust_remote_code off (config/validate.py refuses turning it on): a directory
    that cannot load without running its own Python code becomes one ConfigError instead of a ValueError."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code" not in str(exc):
            raise
        raise ConfigError(f"{key}: {path} needs its own Python code to load (a custom architecture, config or "
                          "tokenizer class); dsrecipes never runs code from a model directory (trust_remote_code "
                          "stays off): use a model that transformers supports natively") from None
