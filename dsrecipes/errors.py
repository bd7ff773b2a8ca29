"""User-facing errors: one clear message, exit code 2, never a traceback."""

from __future__ import annotations

from typing import Iterable, List


class UserError(Exception):
    """A mistake the user can fix (config, data, environment). Printed without a traceback."""

    exit_code = 2

    def __init__(self, problems: Iterable[str] | str):
        self.problems: List[str] = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))

    def render(self) -> str:
        if len(self.problems) == 1:
            return f"error: {self.problems[0]}"
        lines = [f"error: {len(self.problems)} problems:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class ConfigError(UserError):
    """The composed configuration is invalid (unknown key, bad type, broken rule)."""


class DataError(UserError):
    """Input data is malformed; messages name `file:line`."""
