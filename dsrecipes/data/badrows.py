"""Bad rows: the reasons a row (or a whole file) cannot be used, and the policy that applies to them.

`dataset.bad_rows=error` stops at the first bad row with `file:line: reason`; `skip` counts rows by reason, writes
each one to `<run>/quarantine.jsonl` and fails when more than `dataset.max_bad_fraction` of the rows are bad.
"""

from __future__ import annotations

from collections import Counter
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from dsrecipes.config.schema import BadRows
from dsrecipes.errors import DataError
from dsrecipes.fileio import json_text


class BadReason(str, Enum):
    invalid_json = "invalid_json"
    invalid_utf8 = "invalid_utf8"
    not_an_object = "not_an_object"
    missing_conversation = "missing_conversation"  # the messages column is absent
    conversation_not_list = "conversation_not_list"
    empty_conversation = "empty_conversation"
    turn_not_object = "turn_not_object"
    unknown_role = "unknown_role"
    bad_value = "bad_value"  # missing or non-string turn text / system / tools / alpaca field
    missing_field = "missing_field"  # alpaca: instruction or output absent
    system_not_first = "system_not_first"
    no_assistant_turn = "no_assistant_turn"
    template_error = "template_error"  # template=tokenizer: the chat_template refused the conversation
    empty_file = "empty_file"
    no_matching_path = "no_matching_path"


class BadRow(Exception):
    """One row (or file) that cannot be used; `reason` is counted, `detail` explains."""

    def __init__(self, reason: BadReason, detail: str = ""):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)


class BadRowReport:
    """Counts bad rows by reason; `error` policy raises at the first one, `skip` quarantines and goes on."""

    def __init__(self, policy: BadRows, max_bad_fraction: float, quarantine_path: Optional[Path] = None):
        self.policy = policy
        self.max_bad_fraction = max_bad_fraction
        self.quarantine_path = quarantine_path
        self.counts: Counter = Counter()
        self.rows_read = 0  # rows seen (good + bad), file-level problems included
        self.trailing_turns_dropped = 0  # conversations that lost trailing non-assistant turns
        self._fh = None

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def add(self, path: str, loc: Optional[int], bad: BadRow, raw: Any = None) -> None:
        """`loc`: line (JSONL) or index (JSON array); None for a problem with the whole file or pattern."""
        where = path if loc is None else f"{path}:{loc}"
        if self.policy is BadRows.error:
            detail = f" ({_short(bad.detail)})" if bad.detail else ""
            raise DataError(f"{where}: {bad.reason.value}{detail}; set dataset.bad_rows=skip to quarantine bad rows")
        self.counts[bad.reason.value] += 1
        if self.quarantine_path is not None:
            if self._fh is None:
                self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.quarantine_path, "w", encoding="utf-8")
            entry = {"file": path, "line": loc, "reason": bad.reason.value, "detail": bad.detail, "raw": raw}
            self._fh.write(json_text(entry, indent=None))  # strict JSON: a row's NaN becomes null

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def check(self, total: Optional[int] = None) -> None:
        """DataError when more than `max_bad_fraction` of `total` rows (default: rows read) were bad."""
        self.close()
        total = self.rows_read if total is None else total
        if total and self.skipped / total > self.max_bad_fraction:
            raise DataError(
                f"{self.skipped} of {total} rows are bad ({self.skipped / total:.1%} > dataset.max_bad_fraction="
                f"{self.max_bad_fraction}): {self.summary()}"
                + (f"; see {self.quarantine_path}" if self.quarantine_path else "")
            )

    def summary(self) -> str:
        if not self.counts:
            return "no bad rows"
        return ", ".join(f"{reason}={n}" for reason, n in sorted(self.counts.items()))


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

