"""Objectives: what the training step optimises, chosen by `objective.kind` (config group `objective`).

    build_objective(cfg, tokenizer) -> Objective     (the contract: objectives/base.py)

One module per `ObjectiveKind`; `builders()` is the table (tests/test_objectives.py checks it is complete). The
table imports its modules when called, so importing this package (data/render/labels.py does, for IGNORE_INDEX) costs no
torch import.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from dsrecipes.core.schema import ObjectiveKind, TrainConfig
from dsrecipes.objectives.base import Objective

Builder = Callable[[TrainConfig, Any], Objective]


def builders() -> Dict[ObjectiveKind, Builder]:
    from dsrecipes.objectives import dpo, sft  # lazy: else `commands.train` imports torch 3.80 s

    return {ObjectiveKind.sft: sft.build, ObjectiveKind.dpo: dpo.build}


def build_objective(cfg: TrainConfig, tokenizer: Any) -> Objective:
    """The objective of `cfg` for `tokenizer` (its pad id pads every batch)."""
    return builders()[cfg.objective.kind](cfg, tokenizer)
