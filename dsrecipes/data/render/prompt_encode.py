"""Prompts -> token rows (`rows=prompt`): render the prompt as the template opens a reply, tokenize, check the budget.

A prompt is ONE sample (one row, one id) for every strategy and guarantee, exactly like a pair.

Row: `ids` ([sample id]), `prompt_ids` (the prompt rendered through the assistant header the reply follows: the
text a pair's answers continue, `PairEncoder.split`), `reference` (the reference answer, "" for none).

Budget: the completions an online objective samples get `objective.max_completion_length` new tokens, so a prompt
must fit in `data.cutoff_len - objective.max_completion_length` tokens; a longer one is a bad row
(`prompt_too_long`: with `dataset.bad_rows=error` the run stops before training with `file:line` and the numbers).
Prompts are never truncated (a cut prompt asks another question).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from dsrecipes.core.schema import DatasetConfig, SourceConfig, TrainConfig
from dsrecipes.data.render.preference_encode import PairEncoder, checked_in_chunks
from dsrecipes.data.sources.badrows import BadReason, BadRow, BadRowReport
from dsrecipes.data.sources.preference import Pair
from dsrecipes.data.sources.prompts import Prompt, prompt_of
from dsrecipes.data.sources.sharegpt import iter_capped, iter_checked

Row = Dict[str, Any]


class PromptEncoder:
    """Prompts -> rows (or BadRow) for one template, tokenizer, cutoff_len and completion length."""

    def __init__(self, tokenizer: Any, cfg: TrainConfig):
        self.pairs = PairEncoder(tokenizer, cfg)
        self.tokenizer = tokenizer
        self.budget = cfg.data.cutoff_len - cfg.objective.max_completion_length

    def text(self, prompt: Prompt) -> str:
        """The prompt's text through the header of the reply (what a pair's answers follow)."""
        text, _ = self.pairs.split(Pair(prompt.prompt, "", ""), "x")
        return text

    def encode_batch(self, prompts: Sequence[Prompt]) -> List[Union[Row, BadRow]]:
        split = self.pairs.split_all([(Pair(prompt.prompt, "", ""), "x") for prompt in prompts])  # as `text`, together
        texts: List[Optional[str]] = [None if isinstance(got, BadRow) else got[0] for got in split]
        out: List[Union[Row, BadRow, None]] = [got if isinstance(got, BadRow) else None for got in split]
        keys = {t: n for n, t in enumerate(dict.fromkeys(t for t in texts if t is not None))}
        ids, refused = self.pairs.encoder._encode_segments([(False, t) for t in keys])
        for n, (prompt, text) in enumerate(zip(prompts, texts)):
            if text is None:
                continue
            k = keys[text]
            out[n] = (BadRow(BadReason.tokenizer_error, refused[k]) if k in refused
                      else self._row(prompt, ids[k]))
        return out  # type: ignore[return-value]

    def _row(self, prompt: Prompt, tokens: List[int]) -> Union[Row, BadRow]:
        if len(tokens) > self.budget:
            return BadRow(BadReason.prompt_too_long, f"the prompt has {len(tokens)} tokens; data.cutoff_len - "
                          f"objective.max_completion_length leaves {self.budget}")
        return {"ids": [prompt.prompt.id], "prompt_ids": list(tokens), "reference": prompt.reference or ""}


def checked_prompts(cfg: TrainConfig, report: BadRowReport, encoder: PromptEncoder, sources: Sequence[SourceConfig],
                    chunk: int = 256) -> Iterator[Tuple[Prompt, Row]]:
    """(prompt, row) of every prompt of `sources` in order that passes training's checks; bad rows go to `report`."""
    return checked_in_chunks(_all_prompts(cfg.dataset, sources, report), encoder.encode_batch, report, chunk)


def read_and_encode_prompts(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig],
                            report: BadRowReport) -> Tuple[List[Row], List[str]]:
    """(rows, source name of each row) of every source in order, caps and bad-row policy applied."""
    got = list(checked_prompts(cfg, report, PromptEncoder(tokenizer, cfg), sources))
    return [row for _, row in got], [p.prompt.source for p, _ in got]


def _all_prompts(ds: DatasetConfig, sources: Sequence[SourceConfig], report: BadRowReport) -> Iterator[Prompt]:
    return iter_capped(ds, list(sources),
                       lambda source, limit: iter_checked(source, report, limit, ds.max_row_bytes, prompt_of))
