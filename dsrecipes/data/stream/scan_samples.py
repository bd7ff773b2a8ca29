"""The row pre-scan of a stream of rows that are one sample around a prompt (`rows=pair`, `rows=prompt`:
`samples.SampleKind`): `scan_files.RowChecker`'s part for such rows, with the checks of the loader workers (the
kind's `parse_item`, then its encoder's `encode_batch`: reading, rendering, tokenizing, truncation or the prompt
budget). It records a `FileScan` exactly like the conversation checker, so the scan cache, caps, bad-row policy and
quarantine of `scan.py` apply to every kind unchanged. One implementation for every such kind, parameterised by it
(data/rowkinds.py: the kind's `checker`).
"""

from __future__ import annotations

from typing import Any, Optional

from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.samples import SampleKind
from dsrecipes.data.stream.scan_files import RowChecker


class SampleChecker(RowChecker):
    """The checks of training for the rows of one file of `kind`, fed in file order: `row(loc, raw)`."""

    def __init__(self, kind: SampleKind, name: str, source: Any, element: bool, limit: int, encoder: Any):
        super().__init__(name, source, element, limit, encoder)
        self.kind = kind

    def parse(self, raw: Optional[bytes], loc: int) -> Any:
        return self.kind.parse_item(raw, self.name, loc, self.source, self.table, limit=self.limit,
                                    element=self.element)

    def read(self, index: int, sample: Any) -> None:
        """A prompt row's missing reference answer (its kind's `reference` column) is recorded: the run's comparing
        rewards need it (data/prepare/prompts.reference_lines)."""
        columns = self.kind.columns(sample)
        if "reference" not in columns:
            return
        if self.scan.no_reference is None:
            self.scan.no_reference = []
        if columns["reference"] is None:
            self.scan.no_reference.append(index)

    def dropped(self, sample: Any) -> bool:
        return False  # a prompt ends with the turn the answers reply to: nothing trailing to drop

    def _encode(self) -> None:
        if not self._batch:
            return
        got = self.encoder.encode_batch([s for _, s in self._batch])
        for (index, sample), result in zip(self._batch, got):
            if isinstance(result, BadRow):
                conv = sample.prompt
                loc = conv.loc if conv.loc is not None else conv.element
                self.scan.bad.append([index, self.line(loc), result.reason.value, result.detail,
                                      self.kind.canonical(sample), conv.element])
        self._batch = []
