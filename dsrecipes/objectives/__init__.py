"""Objectives: what the training step optimises, chosen by `objective.kind` (config group `objective`).

    build_objective(cfg, tokenizer) -> Objective     (the contract: objectives/base.py)

One module per `ObjectiveKind`, named after its value (`objectives/<kind>.py` with `build(cfg, tokenizer)`), and one
option file `conf/objective/<kind>.yaml` that declares the rows it trains on (`rows`, a `RowKind`; the module's
objective declares the same `row_kind`, checked here). `builders()` is the table (tests/test_objectives.py checks it
is complete): adding an objective is its module, its option file and its Enum value. The table imports its modules
when called, so importing this package (data/render/labels.py does, for IGNORE_INDEX) costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import ObjectiveKind, TrainConfig
from dsrecipes.objectives.base import Objective

Builder = Callable[[TrainConfig, Any], Objective]


def builders() -> Dict[ObjectiveKind, Builder]:
    """{kind: build} of every objective: `dsrecipes.objectives.<kind value>.build`."""
    return {kind: importlib.import_module(f"{__name__}.{kind.value}").build for kind in ObjectiveKind}


def build_objective(cfg: TrainConfig, tokenizer: Any) -> Objective:
    """The objective of `cfg` for `tokenizer` (its pad id pads every batch); its rows must be the ones the option
    file declared (`objective.rows`), which the data layer read them by."""
    objective = builders()[cfg.objective.kind](cfg, tokenizer)
    if objective.row_kind is not cfg.objective.rows:
        raise ConfigError(f"objective.rows: objective={cfg.objective.kind.value} trains on {objective.row_kind.value} "
                          f"rows, not {cfg.objective.rows.value}; drop the objective.rows override")
    return objective
