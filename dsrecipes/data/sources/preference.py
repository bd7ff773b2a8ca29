"""Preference rows -> checked pairs (a prompt conversation, a chosen and a rejected answer), for `objective.rows=pair`.

Formats (per source, `format`):
- `sharegpt` (LLaMA-Factory, `ranking: true` in dataset_info.json): `conversations` holds the prompt turns (ending
  with a user turn), `chosen` and `rejected` one assistant message each (`{"from": "gpt", "value": ...}`, or a
  list of exactly one such message); `system` / `tools` as for SFT rows.
- `openai` (TRL conversational): `prompt`, `chosen`, `rejected` are message lists (`{"role", "content"}`); each
  answer list holds exactly one assistant message. A system message opening the prompt is its system prompt. TRL's
  standard (plain-text) rows are read too: a string `prompt` is one user turn, a string `chosen` / `rejected` one
  assistant answer, rendered with the template like every other pair (TRL trains such rows untemplated). Without a
  `prompt` column, `chosen` and `rejected` are whole conversations (TRL's implicit prompt, e.g. RewardTrainer's
  chosen/rejected rows): their longest common prefix of messages is the prompt, the rest of each its answer, as
  TRL's `extract_prompt` splits them.

Every malformed pair is a bad row (counted by reason, `file:line`, quarantined or fatal per `dataset.bad_rows`,
exactly like SFT rows): `missing_side` (no chosen / no rejected), `side_not_assistant` (an answer that is not one
assistant turn), `empty_answer`, `identical_sides`, plus every check of the prompt's messages that SFT rows get
(`missing_conversation`, `unknown_role`, ...); a prompt that does not end with a user (or tool output) turn is a
`bad_value`. `prompt_too_long` is decided after tokenization (data/render/preference_encode.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import DatasetConfig, DatasetFormat, PairsAs, RowKind, SourceConfig
from dsrecipes.data.rowkinds import ROW_KINDS
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.samples import SampleKind, prompt_conversation
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn, _message_turns, prompt_advice


@dataclass
class Pair:
    prompt: Conversation  # the prompt turns (no reply yet), system, tools, id and where it was read
    chosen: str
    rejected: str
    margin: Optional[float] = None  # the row's `margin` (TRL's reward-model column): objective=reward's target gap


def check_sources(rows: RowKind, sources: List[SourceConfig]) -> None:
    """Preference sources only for an objective on pairs (`objective.rows`), no source that says it is not one, no
    `pairs_as: chosen` (a registry entry's; the command line's is config/validate's) outside SFT, and each source in
    a format its row kind is read in (rowkinds.py: the kind's `sources`)."""
    wanted = ROW_KINDS[rows].sources
    for src in sources:
        if wanted.ranking and src.ranking is False:
            raise ConfigError(f"dataset: source {src.name!r} is not preference data (its registry entry has no "
                              f"`ranking: true`); this objective (objective.rows={rows.value}) trains on "
                              "chosen/rejected pairs")
        if not wanted.ranking and src.ranking and not (rows is RowKind.conversation and src.pairs_as is PairsAs.chosen):
            sft = (", or SFT on each pair's prompt + chosen answer (DeepSpeed-Chat's step 1) with "
                   "dataset.pairs_as=chosen") if rows is RowKind.conversation else ""
            raise ConfigError(f"dataset: source {src.name!r} holds preference (ranking) rows; train on it with an "
                              f"objective on pairs (objective.rows=pair: objective=dpo, for one){sft}")
        if rows is not RowKind.conversation and src.pairs_as is PairsAs.chosen:  # a registry entry's own
            raise ConfigError(f"dataset: source {src.name!r} sets pairs_as: chosen, which reads a pair row as an SFT "
                              f"conversation (objective=sft); objective.rows={rows.value} reads its rows as they are, "
                              "so leave it unset (refuse)")
        if src.format not in wanted.formats:
            raise ConfigError(f"dataset: source {src.name!r}: {rows.value} rows are read in the "
                              f"{' or '.join(_FORMAT_NAMES[f] for f in wanted.formats)} format, not {src.format.value}")


def pairs_as_problems(dataset: DatasetConfig, rows: RowKind) -> List[str]:
    """`dataset.pairs_as` (and a source's own) is read by objectives on conversations only (config/validate.py)."""
    keys = [("dataset.pairs_as", dataset.pairs_as)] + [(f"dataset.sources[{i}].pairs_as", s.pairs_as)
                                                       for i, s in enumerate(dataset.sources)]
    if rows is RowKind.conversation:
        return []
    return [f"{key}: chosen reads a pair row as an SFT conversation (objective=sft); objective.rows={rows.value} "
            "reads its rows as they are, so leave it unset (refuse)" for key, value in keys if value is PairsAs.chosen]


_FORMAT_NAMES = {DatasetFormat.sharegpt: "sharegpt (LLaMA-Factory)", DatasetFormat.openai: "openai (TRL)",
                 DatasetFormat.alpaca: "alpaca"}


NOT_A_PAIR = ("this looks like an SFT conversation: objective=dpo, objective=reward and `dsrecipes score --pairs` "
              "read pairs (a prompt, a chosen and a rejected answer; see dataset=sample_pairs and README \"Preference "
              "tuning (DPO)\"); objective=sft trains on conversations")


PAIRS_READ = "objective=dpo, objective=reward and `dsrecipes score --pairs` read pairs (a chosen and a rejected answer)"


def _pair(raw: Dict[str, Any], source: SourceConfig, roles: Dict[str, Role]) -> Pair:
    cols = source.columns
    if cols.chosen not in raw and cols.rejected not in raw:  # before the prompt: an SFT row ends with its answer
        raise BadRow(BadReason.missing_side, f"no {cols.chosen!r} and no {cols.rejected!r} answer: a pair row holds "
                                             "a prompt and a chosen and a rejected answer (an SFT conversation?)",
                     advice=prompt_advice(raw, source, PAIRS_READ) or NOT_A_PAIR)
    if source.format is DatasetFormat.openai and cols.prompt not in raw:
        raw = implicit_prompt(raw, source)
    conv = prompt_conversation(raw, source, roles)
    chosen, rejected = (_answer(raw, side, source, roles) for side in (cols.chosen, cols.rejected))
    if chosen == rejected:
        raise BadRow(BadReason.identical_sides, "chosen and rejected are the same text")
    margin = raw.get("margin")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not math.isfinite(margin)):
        raise BadRow(BadReason.bad_value, f"margin must be a finite number, got {margin!r}")
    return Pair(conv, chosen, rejected, None if margin is None else float(margin))


def implicit_prompt(raw: Dict[str, Any], source: SourceConfig) -> Dict[str, Any]:
    """TRL's implicit prompt (trl.data_utils.extract_prompt): `chosen` and `rejected` message lists that share their
    first messages -> those as `prompt`, the rest of each as its answer. Anything else as it is (its checks say why)."""
    cols = source.columns
    chosen, rejected = raw.get(cols.chosen), raw.get(cols.rejected)
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        return raw
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if not shared:
        return raw
    return {**raw, cols.prompt: chosen[:shared], cols.chosen: chosen[shared:], cols.rejected: rejected[shared:]}


def _answer(raw: Dict[str, Any], side: str, source: SourceConfig, roles: Dict[str, Role]) -> str:
    value: Optional[Any] = raw.get(side)
    if value is None:
        raise BadRow(BadReason.missing_side, f"no {side!r} answer")
    if isinstance(value, str) and source.format is DatasetFormat.openai:  # TRL's standard (plain-text) pair
        turns: List[Turn] = [Turn(Role.assistant, value)]
    else:
        messages = value if isinstance(value, list) else [value]
        turns = _message_turns({source.columns.messages: messages}, source, roles) if messages else []
    if len(turns) != 1 or turns[0].role is not Role.assistant:
        got = [t.role.value for t in turns]
        raise BadRow(BadReason.side_not_assistant, f"{side!r} must be one assistant message, got roles {got}")
    if not turns[0].content.strip():
        raise BadRow(BadReason.empty_answer, f"{side!r} has no text")
    return turns[0].content


def _pair_columns(pair: Pair) -> Dict[str, Any]:
    return {"chosen": {"from": Role.assistant.value, "value": pair.chosen},
            "rejected": {"from": Role.assistant.value, "value": pair.rejected}, "margin": pair.margin}


PAIRS: SampleKind[Pair] = SampleKind(_pair, _pair_columns, lead=("chosen", "rejected"))
pair_of = PAIRS.of  # a row as read -> Pair, or BadRow
parse_pair_item = PAIRS.parse_item  # one raw line of a stream or a presharded part -> Pair, or BadRow
pair_row = PAIRS.canonical  # a checked pair as `dsrecipes shard` writes it (`PAIR_ROW_FORMAT`)
