"""The row pre-scan of a stream of prompts (`rows=prompt data=iterable`): `scan_files.RowChecker`'s part for prompt
rows, with the checks of the loader workers (`prompts.parse_prompt_item`, then `PromptEncoder.encode_batch`:
reading, rendering, tokenizing, the prompt budget). It records a `FileScan` like the pair checker, so the scan
cache, caps, bad-row policy and quarantine of `scan.py` apply to prompts unchanged.
"""

from __future__ import annotations

from typing import Any, Optional

from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.prompts import Prompt, parse_prompt_item, prompt_row
from dsrecipes.data.stream.scan_files import RowChecker


class PromptChecker(RowChecker):
    """The checks of training for the prompt rows of one file, fed in file order: `row(loc, raw)` (scan_files.py)."""

    def parse(self, raw: Optional[bytes], loc: int) -> Prompt:
        return parse_prompt_item(raw, self.name, loc, self.source, self.table, limit=self.limit, element=self.element)

    def dropped(self, prompt: Any) -> bool:
        return False  # a prompt ends with a user turn: nothing trailing to drop

    def _encode(self) -> None:
        if not self._batch:
            return
        got = self.encoder.encode_batch([p for _, p in self._batch])
        for (sample, prompt), result in zip(self._batch, got):
            if isinstance(result, BadRow):
                conv = prompt.prompt
                loc = conv.loc if conv.loc is not None else conv.element
                self.scan.bad.append([sample, self.line(loc), result.reason.value, result.detail, prompt_row(prompt),
                                      conv.element])
        self._batch = []
