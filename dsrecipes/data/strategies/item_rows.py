"""What the row encoders of a stream share (`rows.RowEncoder` for conversations, `sample_rows.SampleRowEncoder` for
pairs and prompts): items (file index, location, raw line[, copy]) -> parsed samples under `dataset.bad_rows`.

`paths` name the files as the user gave them (a converted JSON array keeps its own name; the location is then the
element: `element_files`). `error` raises DataError naming `file:line` (or `file: element N (line L)`); `skip` drops
the row (its slot in the micro-batch stays empty, so no other rank's sample moves) and counts it in `skipped`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import BadRows, TrainConfig
from dsrecipes.data.sources.badrows import BadRow, error_message
from dsrecipes.data.sources.files import where
from dsrecipes.data.sources.sharegpt import role_table


class ItemRows:
    def __init__(self, cfg: TrainConfig, paths: Sequence[str], sources: Sequence[Any],
                 element_files: Optional[Sequence[bool]] = None):
        self.paths = list(paths)
        self.sources = list(sources)
        self.tables = [role_table(s) for s in self.sources]
        self.policy = cfg.dataset.bad_rows
        self.max_row_bytes = cfg.dataset.max_row_bytes
        self.element_files = list(element_files) if element_files is not None else [False] * len(self.paths)
        self.skipped = 0

    def parsed(self, item: Any, parse: Callable[..., Any], named: Callable[[Any], Any]) -> Optional[Any]:
        """The sample of one item (`parse`: `sharegpt.parse_item` or `preference.parse_pair_item`), None for a bad
        row under `skip`. `named(sample)` is what carries the sample's id: a repeat made by a mixing weight > 1 is a
        sample of its own, `<id>@<copy>`."""
        file_index, loc, raw = item[:3]
        path, element = self.paths[file_index], self.element_files[file_index]
        try:
            sample = parse(raw, path, loc, self.sources[file_index], self.tables[file_index],
                           limit=self.max_row_bytes, element=element)
        except BadRow as bad:
            self._bad(where(path, None if element else loc, loc if element else None), bad)
            return None
        if len(item) > 3 and item[3]:
            named(sample).id = f"{named(sample).id}@{item[3]}"
        return sample

    def _bad(self, location: str, bad: Any) -> None:
        if self.policy is BadRows.error:
            raise DataError(error_message(location, bad))
        self.skipped += 1
