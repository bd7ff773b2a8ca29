"""Prompt rows of a stream or a presharded part (`rows=prompt`): raw lines -> prompt rows inside a loader worker.

The counterpart of `pair_rows.PairRowEncoder` for prompts, with the same items, bad-row policy and checks as every
other reader of prompts (`prompts.parse_prompt_item`, then `PromptEncoder.encode_batch`: the checks of map
preparation and of the stream pre-scan). A prompt is one sample: one line, one id (`<id>@<copy>` for a repeat made
by a mixing weight > 1), so exactly-once, equal steps, resume and the ledgers count prompts as they count pairs.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.render.prompt_encode import PromptEncoder
from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.files import where
from dsrecipes.data.sources.prompts import Prompt, parse_prompt_item
from dsrecipes.data.strategies.base import Row
from dsrecipes.data.strategies.item_rows import ItemRows


class PromptRowEncoder(ItemRows):
    """Items (file index, location, raw line[, copy]) -> prompt rows; `skipped` counts bad rows under `skip`."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, paths: Sequence[str], sources: Sequence[Any],
                 element_files: Optional[Sequence[bool]] = None):
        super().__init__(cfg, paths, sources, element_files)
        self.encoder = PromptEncoder(tokenizer, cfg)

    def prompt(self, item: Any) -> Optional[Prompt]:
        return self.parsed(item, parse_prompt_item, lambda prompt: prompt.prompt)

    def __call__(self, items: Sequence[Any]) -> List[Row]:
        prompts = [p for p in (self.prompt(item) for item in items) if p is not None]
        rows: List[Row] = []
        for prompt, got in zip(prompts, self.encoder.encode_batch(prompts) if prompts else []):
            if isinstance(got, BadRow):
                p = prompt.prompt
                self._bad(where(p.path, p.loc, p.element), got)
                continue
            rows.append(got)
        return rows
