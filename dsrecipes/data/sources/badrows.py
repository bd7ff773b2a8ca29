"""Bad rows: the reasons a row (or a whole file) cannot be used, and the policy that applies to them.

`dataset.bad_rows=error` stops at the first bad row with `file:line: reason`; `skip` counts rows by reason and by
file, writes each one to `<run>/quarantine.jsonl` and fails when more than `dataset.max_bad_fraction` of the rows
are bad. A file that cannot be read to its end (corrupt or truncated gzip, a broken JSON array) is not a bad row: the
rows after the break cannot be counted, so it is refused under both policies (`files.FileUnreadable`).

Locations: `file:line` (JSON lines), `file: element N (line L)` (JSON arrays: 0-based element N starting on line L).
"""

from __future__ import annotations

import os
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Optional

from dsrecipes.core.errors import DataError
from dsrecipes.core.fileio import json_text
from dsrecipes.core.schema import BadRows


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
    invalid_text = "invalid_text"  # valid JSON whose strings are not text (a lone UTF-16 surrogate such as \ud800)
    too_deep = "too_deep"  # nested deeper than files.MAX_DEPTH (or deep enough to exhaust Python's recursion)
    too_large = "too_large"  # more than dataset.max_row_bytes bytes (never read whole)
    template_error = "template_error"  # the template could not render the conversation (e.g. a chat_template refused it)
    tokenizer_error = "tokenizer_error"  # the tokenizer raised on the rendered text
    missing_side = "missing_side"  # preference row: no chosen or no rejected answer
    identical_sides = "identical_sides"  # preference row: chosen and rejected are the same text
    empty_answer = "empty_answer"  # preference row: an answer with no text
    side_not_assistant = "side_not_assistant"  # preference row: an answer that is not one assistant turn
    prompt_too_long = "prompt_too_long"  # preference row: the prompt alone fills data.cutoff_len
    preference_row = "preference_row"  # a conversation reader's row holding a pair's chosen/rejected answers
    empty_file = "empty_file"
    no_matching_path = "no_matching_path"


class BadRow(Exception):
    """One row (or file) that cannot be used; `reason` is counted, `detail` explains. `advice`: set where the row is
    of another kind than the objective reads (an SFT conversation where pairs are read, a pair where conversations
    are): what reads that kind of row; `bad_rows=skip` would quarantine every row of such a file, so it replaces
    that advice in the refusal."""

    def __init__(self, reason: BadReason, detail: str = "", advice: str = ""):
        self.reason = reason
        self.detail = detail
        self.advice = advice
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)

    def __reduce__(self):  # to and from worker processes (the default would call BadRow(message))
        return BadRow, (self.reason, self.detail, self.advice)


@dataclass(frozen=True)
class Advice:
    """What the refusal of a bad row says after its reason (`error_message`): `own`, for a row of the kind the run
    reads (by default: quarantine such rows); `after`, said after what reads a row of another kind (BadRow.advice)."""

    own: str = "set dataset.bad_rows=skip to quarantine bad rows"
    after: str = ""


# The advice of bad_rows=error's refusals: the pre-scan's (it quarantines under skip); rows read without it give
# their own, set around their reading (data/stream/unscanned.py)
ADVICE: ContextVar[Advice] = ContextVar("ADVICE", default=Advice())
QUARANTINE_MAX_BYTES = 64 << 20  # a file of tiny bad rows (`[1,1,...]`) would write ~65x its size of entries


class BadRowReport:
    """Counts bad rows by reason; `error` policy raises at the first one, `skip` quarantines and goes on."""

    def __init__(self, policy: BadRows, max_bad_fraction: float, quarantine_path: Optional[Path] = None):
        self.policy = policy
        self.max_bad_fraction = max_bad_fraction
        self.quarantine_path = quarantine_path
        self.counts: Counter = Counter()
        self.by_file: Dict[str, Counter] = {}  # file (or unmatched pattern) -> reason -> rows
        self.advised: Counter = Counter()  # BadRow.advice -> rows: rows of another kind than the objective reads
        self.rows_read = 0  # rows seen (good + bad), file-level problems included
        self.trailing_turns_dropped = 0  # conversations that lost trailing non-assistant turns
        self._fh = None
        self.written = 0  # bytes of quarantine entries written
        self.unwritten = 0  # bad rows counted but not written: the quarantine reached QUARANTINE_MAX_BYTES

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def add(self, path: str, loc: Optional[int], bad: BadRow, raw: Any = None, element: Optional[int] = None) -> None:
        """`loc`: the 1-based line where the row starts; `element`: its 0-based index in a JSON array; loc None for
        a problem with the whole file or pattern."""
        if self.policy is BadRows.error:
            raise DataError(error_message(location(path, loc, element), bad))
        self.counts[bad.reason.value] += 1
        self.by_file.setdefault(path, Counter())[bad.reason.value] += 1
        if bad.advice:
            self.advised[bad.advice] += 1
        if self.quarantine_path is not None:
            if self._fh is None:
                self.quarantine_path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.quarantine_path, "w", encoding="utf-8")
            entry = {"file": path, "line": loc, "element": element, "reason": bad.reason.value,
                     "detail": _short(bad.detail, 2000), "raw": _quarantined(raw)}
            text = json_text(entry, indent=None)  # strict JSON: a row's NaN becomes null
            size = len(text.encode("utf-8"))
            if self.unwritten or self.written + size > QUARANTINE_MAX_BYTES:
                self.unwritten += 1
                return
            self._fh.write(text)
            self.written += size

    def close(self) -> None:
        if self._fh is not None:
            if self.unwritten:  # the last line says what is missing, for whoever reads the file
                self._fh.write(json_text({"file": None, "line": None, "element": None, "reason": None,
                                          "detail": self.cut_note(), "raw": None}, indent=None))
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
                + (f" ({self.cut_note()})" if self.unwritten else "")
                + self.kind_note(total)
            )

    def kind_note(self, total: int) -> str:
        """The advice of the rows of another kind (BadRow.advice) where they alone are past max_bad_fraction: a file
        of the wrong kind, which skipping never makes right; `bad_rows=error` says the same at its first row. Was:
        only 'N of N rows are bad: no_assistant_turn=N' for a pairs file under SFT."""
        if not self.advised:
            return ""
        advice, rows = self.advised.most_common(1)[0]
        if rows / total <= self.max_bad_fraction:
            return ""
        return f"; {advice}" if rows == self.skipped else f"; {rows} of them: {advice}"

    def cut_note(self) -> str:
        return (f"{self.unwritten} more bad rows were counted but not written: the quarantine keeps the first "
                f"{QUARANTINE_MAX_BYTES >> 20} MiB of entries")

    def summary(self) -> str:
        if not self.counts:
            return "no bad rows"
        return ", ".join(f"{reason}={n}" for reason, n in sorted(self.counts.items())) + "; " + by_file_summary(
            self.files())

    def files(self) -> Dict[str, Dict[str, int]]:
        """{file: {reason: rows}}: the bad rows of each file (prepare_stats.json, the shard manifest)."""
        return {path: dict(sorted(c.items())) for path, c in sorted(self.by_file.items())}


def error_message(where: str, bad: BadRow, advice: Optional[Advice] = None) -> str:
    """The one message of `bad_rows=error`: `file:line: reason (detail); ...`: the row kind to use where the row is
    of another kind (`bad.advice`, then `advice.after`), else `advice.own` (`advice`: by default ADVICE's)."""
    advice = advice or ADVICE.get()
    detail = f" ({_short(bad.detail)})" if bad.detail else ""
    said = f"{bad.advice}; {advice.after}" if bad.advice and advice.after else bad.advice or advice.own
    return f"{where}: {bad.reason.value}{detail}; {said}"


def location(path: str, line: Optional[int], element: Optional[int] = None) -> str:
    """`file:line`, `file: element N (line L)` for a JSON array's element, or `file` for the whole file."""
    if element is not None:
        return f"{path}: element {element}" + (f" (line {line})" if line is not None else "")
    return path if line is None else f"{path}:{line}"


def by_file_summary(files: Dict[str, Dict[str, int]], limit: int = 3) -> str:
    """`by file: a.jsonl 2 (invalid_json=1, too_large=1), b.json 1 (...)`, the largest `limit` files first."""
    ranked = sorted(files.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    parts = [f"{os.path.basename(p) or p} {sum(c.values())} (" + ", ".join(f"{r}={n}" for r, n in c.items()) + ")"
             for p, c in ranked[:limit]]
    more = f", and {len(ranked) - limit} more files" if len(ranked) > limit else ""
    return "by file: " + ", ".join(parts) + more


def _quarantined(raw: Any, limit: int = 1 << 16) -> Any:
    """The row as the quarantine keeps it: text longer than `limit` characters is cut (rows can be megabytes)."""
    if isinstance(raw, str) and len(raw) > limit:
        return raw[:limit] + f"... [{len(raw) - limit} more characters]"
    return raw


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

