"""The rows `dsrecipes shard` writes into parts: every row checked as training checks it, in one canonical form.

Two row kinds, recorded in the manifest's `row_format`: conversations (`ROW_FORMAT`: `id`, `conversations: [{from:
<role>, value}]`, `system`, `tools`) and preference pairs (`PAIR_ROW_FORMAT`: the same
columns holding the prompt, plus `chosen` and `rejected` as one assistant message each: `preference.pair_row`),
by the run's `objective.rows`.
Roles are `sharegpt.Role` values, so a part needs no column settings, and sample ids survive (`<source file>:<line>`
when the row had none). A presharded run refuses parts of the other kind (`check_row_format`).
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List, Tuple

from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import RowKind
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.preference import pair_row
from dsrecipes.data.sources.prompts import prompt_row

ROW_FORMAT = "dsrecipes-sharegpt-v1"  # canonical rows: roles are dsrecipes.data.sources.sharegpt.Role values
PAIR_ROW_FORMAT = "dsrecipes-pairs-v1"  # canonical preference pairs (objective.rows=pair): preference.pair_row
PROMPT_ROW_FORMAT = "dsrecipes-prompts-v1"  # canonical prompts (objective.rows=prompt): prompts.prompt_row
FORMATS = {RowKind.conversation: ROW_FORMAT, RowKind.pair: PAIR_ROW_FORMAT,
           RowKind.prompt: PROMPT_ROW_FORMAT}  # every row kind has one
HELD = {ROW_FORMAT: "conversations (SFT rows)", PAIR_ROW_FORMAT: "preference pairs", PROMPT_ROW_FORMAT: "prompts"}


def conversation_row(conv: Any) -> Dict[str, Any]:
    row: Dict[str, Any] = {"id": conv.id, "conversations": [{"from": t.role.value, "value": t.content} for t in conv.turns]}
    if conv.system is not None:
        row["system"] = conv.system
    if conv.tools is not None:
        row["tools"] = conv.tools
    return row


def checked_rows(cfg: Any, report: Any, encoder: Any, sources: List[Any]) -> Iterator[Tuple[bytes, int]]:
    """(canonical line, tokens in a run) of every row that passes training's checks; the policy is enforced at the
    end. A row whose canonical form outgrows `dataset.max_row_bytes` is a bad row here (the parts never hold one)."""
    for where, row, tokens in _canonical_rows(cfg, report, encoder, sources):
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        if len(line) - 1 > cfg.dataset.max_row_bytes:
            report.add(where.path, where.loc, BadRow(BadReason.too_large, "its canonical form is longer than "
                                                     f"dataset.max_row_bytes={cfg.dataset.max_row_bytes}"),
                       None, where.element)
            continue
        yield line, tokens
    report.check()


def _canonical_rows(cfg: Any, report: Any, encoder: Any, sources: List[Any]) -> Iterator[Tuple[Any, Dict, int]]:
    """(the row's Conversation: where it was read, canonical row, tokens in a run) of every checked row: a
    conversation, or a preference pair (objective.rows=pair) (tokens: the prompt and both answers)."""
    from dsrecipes.data.render.preference_encode import checked_pairs  # lazy: else `commands.shard` imports numpy
    from dsrecipes.data.stream.scan import checked_conversations  # lazy: else `commands.shard` imports numpy 0.11 s

    if row_format(cfg) == PROMPT_ROW_FORMAT:
        from dsrecipes.data.render.prompt_encode import checked_prompts  # lazy: as checked_pairs (numpy)
        for prompt, row in checked_prompts(cfg, report, encoder, sources):
            yield prompt.prompt, prompt_row(prompt), len(row["prompt_ids"])
        return
    if row_format(cfg) == PAIR_ROW_FORMAT:
        for pair, row in checked_pairs(cfg, report, encoder, sources):
            yield pair.prompt, pair_row(pair), sum(len(row[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
        return
    for conv, example in checked_conversations(cfg, report, encoder, sources):
        yield conv, conversation_row(conv), 0 if example is None else len(example.input_ids)


def row_format(cfg: Any) -> str:
    """The canonical rows a run of `cfg` reads from parts: those of its objective's row kind (`objective.rows`)."""
    return FORMATS[cfg.objective.rows]


def check_row_format(manifest: Any, cfg: Any) -> None:
    """Parts hold the rows of the objective they were sharded for; refuse training another objective on them."""
    want = row_format(cfg)
    if manifest.row_format == want:
        return
    held = HELD.get(manifest.row_format, "rows of another kind")
    raise DataError(f"data.shard_dir: {manifest.directory} holds {held} (row_format {manifest.row_format}), but "
                    f"this run's objective trains on {HELD[want]} (objective.rows={cfg.objective.rows.value}); shard "
                    "the data for this objective: `dsrecipes shard INPUT... --parts N --out NEW_DIR objective=<the "
                    "run's objective>`")
