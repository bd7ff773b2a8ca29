"""Preference pairs -> token rows (`rows=pair`): render, tokenize, truncate; read every source of a preparation.

A pair is ONE sample (one row, one id) for every strategy and guarantee: the prompt is stored once and both answers
beside it, so exactly-once, equal steps, resume and ledgers count pairs exactly as they count SFT samples.

Row: `ids` ([sample id]), `prompt_ids`, `chosen_ids` / `chosen_labels`, `rejected_ids` / `rejected_labels` (labels:
the answer's token or -100 where the template does not train it, e.g. a role header inside the answer span).

Rendering: the prompt turns plus one answer are rendered by the run's template with `train_on=last_assistant`; the
text before the answer's first trained segment is the prompt (it must be the same for both answers, else the
template is a `template_error` for this row), the rest through the end of the turn is the answer. The prompt and
each answer segment are tokenized on their own (answers as continuations, no SentencePiece start marker), as TRL
tokenizes the prompt and the completion apart.

Truncation (`data.cutoff_len` bounds prompt + answer, for each side), TRL's rule with max_prompt_length =
cutoff_len / 2: a prompt of cutoff_len tokens or more leaves no room for an answer and is a bad row
(`prompt_too_long`); otherwise, when prompt + the longer answer do not fit, the prompt keeps its TAIL of
max(cutoff_len - longer answer, cutoff_len // 2) tokens and both answers keep their HEAD of cutoff_len - kept
prompt tokens. Both sides always share the same prompt tokens (aligned), so their log-probabilities compare answers
only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from dsrecipes.core.schema import DatasetConfig, SourceConfig, TrainConfig, TrainOn
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.template import Segment
from dsrecipes.data.render.tokenize import Encoder
from dsrecipes.data.sources.badrows import BadReason, BadRow, BadRowReport
from dsrecipes.data.sources.preference import Pair, pair_of
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn, iter_capped, iter_checked

Row = Dict[str, Any]


class PairEncoder:
    """Pairs -> rows (or BadRow) for one template, tokenizer and cutoff_len."""

    def __init__(self, tokenizer: Any, cfg: TrainConfig):
        last = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_on=TrainOn.last_assistant))
        self.encoder = Encoder(tokenizer, last, full_text=False)
        self.tokenizer = tokenizer
        self.cutoff_len = cfg.data.cutoff_len

    def split(self, pair: Pair, answer: str) -> Tuple[str, List[Segment]]:
        """(prompt text, answer segments) of the prompt followed by one answer."""
        return _cut(self.encoder.render(_answered(pair, answer)))

    def split_all(self, items: Sequence[Tuple[Pair, str]]) -> List[Union[Tuple[str, List[Segment]], BadRow]]:
        """`split` of each (pair, answer), or its BadRow: rendered together (a model's own template in one exchange
        with its sandbox per chunk, Encoder.render_all)."""
        out: List[Union[Tuple[str, List[Segment]], BadRow]] = []
        for got in self.encoder.render_all([_answered(pair, answer) for pair, answer in items]):
            try:
                out.append(got if isinstance(got, BadRow) else _cut(got))
            except BadRow as bad:
                out.append(bad)
        return out

    def encode_batch(self, pairs: Sequence[Pair]) -> List[Union[Row, BadRow]]:
        parts: List[Optional[Tuple[str, List[Segment], List[Segment]]]] = []
        out: List[Union[Row, BadRow, None]] = []
        keys: Dict[Tuple[bool, str], int] = {}
        sides = self.split_all([(pair, answer) for pair in pairs for answer in (pair.chosen, pair.rejected)])
        for n, pair in enumerate(pairs):
            try:
                (prompt, chosen), (prompt_r, rejected) = (_ok(sides[2 * n]), _ok(sides[2 * n + 1]))
                if prompt != prompt_r:
                    raise BadRow(BadReason.template_error, "the template renders the prompt differently per answer")
            except BadRow as bad:
                parts.append(None)
                out.append(bad)
                continue
            parts.append((prompt, chosen, rejected))
            out.append(None)
            for key in [(False, prompt)] + [(True, s.text) for s in chosen + rejected]:
                keys.setdefault(key, len(keys))
        ids, refused = self.encoder._encode_segments(list(keys))
        for n, (pair, part) in enumerate(zip(pairs, parts)):
            if part is None:
                continue
            needed = [(False, part[0])] + [(True, s.text) for s in part[1] + part[2]]
            failed = next((refused[keys[k]] for k in needed if keys[k] in refused), None)
            if failed is not None:
                out[n] = BadRow(BadReason.tokenizer_error, failed)
                continue
            out[n] = self._row(pair.prompt.id, ids[keys[(False, part[0])]],
                               *(_answer_tokens(segs, ids, keys) for segs in part[1:]))
            if pair.margin is not None and isinstance(out[n], dict):
                out[n]["margin"] = pair.margin  # type: ignore[index]  (objective=reward: TRL's margin column)
        return out  # type: ignore[return-value]

    def _row(self, sample_id: str, prompt: List[int], chosen: Tuple[List[int], List[int]],
             rejected: Tuple[List[int], List[int]]) -> Union[Row, BadRow]:
        limit = self.cutoff_len
        if len(prompt) >= limit:
            return BadRow(BadReason.prompt_too_long, f"the prompt has {len(prompt)} tokens; data.cutoff_len is {limit}")
        longest = max(len(chosen[0]), len(rejected[0]))
        truncated = len(prompt) + longest > limit
        if truncated:
            keep = min(len(prompt), max(limit - longest, limit // 2))
            prompt = prompt[len(prompt) - keep:]
            room = limit - keep
            chosen, rejected = (chosen[0][:room], chosen[1][:room]), (rejected[0][:room], rejected[1][:room])
        if all(lab == IGNORE_INDEX for lab in chosen[1]) or all(lab == IGNORE_INDEX for lab in rejected[1]):
            return BadRow(BadReason.empty_answer, "an answer has no trained token")
        return {"ids": [sample_id], "prompt_ids": list(prompt), "chosen_ids": list(chosen[0]),
                "chosen_labels": list(chosen[1]), "rejected_ids": list(rejected[0]),
                "rejected_labels": list(rejected[1]), "truncated": truncated}


def _answered(pair: Pair, answer: str) -> Conversation:
    p = pair.prompt
    return Conversation(p.id, [*p.turns, Turn(Role.assistant, answer)], p.system, p.tools, p.source)


def _cut(segs: List[Segment]) -> Tuple[str, List[Segment]]:
    """(prompt text, answer segments) of a rendered prompt and answer."""
    first = next((i for i, s in enumerate(segs) if s.trained), None)
    end = max((i for i, s in enumerate(segs) if s.closes_turn), default=None)
    if first is None or end is None or end < first:
        raise BadRow(BadReason.template_error, "the template trains no part of the answer")
    return "".join(s.text for s in segs[:first]), segs[first:end + 1]


def _ok(side: Union[Tuple[str, List[Segment]], BadRow]) -> Tuple[str, List[Segment]]:
    if isinstance(side, BadRow):
        raise side
    return side


def _answer_tokens(segs: List[Segment], ids: List[List[int]], keys: Dict[Tuple[bool, str], int]
                   ) -> Tuple[List[int], List[int]]:
    tokens: List[int] = []
    labels: List[int] = []
    for seg in segs:
        part = ids[keys[(True, seg.text)]]
        tokens += part
        labels += part if seg.trained else [IGNORE_INDEX] * len(part)
    return tokens, labels


def iter_pairs(source: SourceConfig, report: BadRowReport, limit: Optional[int],
               max_row_bytes: int) -> Iterator[Pair]:
    """Pairs of one source in file order; bad rows go to `report`; stops after `source.max_samples` (or `limit`)."""
    return iter_checked(source, report, limit, max_row_bytes, pair_of)


def checked_pairs(cfg: TrainConfig, report: BadRowReport, encoder: "PairEncoder", sources: Sequence[SourceConfig],
                  chunk: int = 256) -> Iterator[Tuple[Pair, Row]]:
    """(pair, row) of every pair of `sources` in order that passes training's checks (reading, rendering,
    tokenizing, truncation); caps apply as in map preparation; bad rows go to `report` (its policy decides)."""
    return checked_in_chunks(_all_pairs(cfg.dataset, sources, report), encoder.encode_batch, report, chunk)


def checked_in_chunks(items: Iterable[Any], encode_batch: Callable[[List[Any]], List[Any]], report: BadRowReport,
                      chunk: int) -> Iterator[Tuple[Any, Row]]:
    """(item, row) of each item (a pair or a prompt: `.prompt` says where it was read) encoded `chunk` at a time,
    in order; an item whose encoding is a BadRow goes to `report` instead."""
    pending: List[Any] = []

    def flush() -> Iterator[Tuple[Any, Row]]:
        for item, got in zip(pending, encode_batch(pending)):
            if isinstance(got, BadRow):
                p = item.prompt
                report.add(p.path, p.loc, got, None, p.element)
                continue
            yield item, got
        pending.clear()

    for item in items:
        pending.append(item)
        if len(pending) >= chunk:
            yield from flush()
    yield from flush()


def read_and_encode_pairs(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig],
                          report: BadRowReport, chunk: int = 256) -> Tuple[List[Row], List[str]]:
    """(rows, source name of each row) of every source in order, caps and bad-row policy applied like SFT reading
    (in this process: preference sets are small next to SFT corpora)."""
    rows: List[Row] = []
    names: List[str] = []
    for pair, row in checked_pairs(cfg, report, PairEncoder(tokenizer, cfg), sources, chunk):
        rows.append(row)
        names.append(pair.prompt.source)
    return rows, names


def _all_pairs(ds: DatasetConfig, sources: Sequence[SourceConfig], report: BadRowReport) -> Iterator[Pair]:
    return iter_capped(ds, list(sources), lambda source, limit: iter_pairs(source, report, limit, ds.max_row_bytes))
