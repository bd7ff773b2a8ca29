"""What each data strategy requires of a config, for the collect-all validation (`config/validate.py`); no I/O.

Kept apart from the strategy modules on purpose: they prepare data (data/prepare/build.py, data/prepare/cache.py), which imports
the config loader, which validates; this module imports only the schema, so validation asks it without an import
cycle. `RULES` has one entry per `DataKind` (tests/test_strategy_table.py checks it with `STRATEGIES`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from dsrecipes.core.schema import DataKind, TrainConfig

NamedPath = Tuple[str, Optional[str]]  # (config key, path) that must exist when files are checked


@dataclass(frozen=True)
class Rules:
    problems: Callable[[TrainConfig], List[str]]  # one message per broken rule, each naming its key
    paths: Callable[[TrainConfig], List[NamedPath]] = lambda cfg: []
    reads_sources: bool = True  # trains on dataset.paths/sources/use (presharded: on the shards' manifest)
    prompt_rows: bool = False  # its prepared validation split can feed prompt-evals during training (gen_eval.py)
    pairs: bool = False  # it carries preference pairs (objective.rows=pair): one pair is one sample
    reference_cache: bool = False  # objective.reference=precomputed: reference log-probs cached with prepared pairs
    split_refusal: Optional[str] = None  # why it cannot read one share of dataset.split (None: it can)
    parquet: bool = True  # it reads Parquet files (iterable indexes byte offsets of lines: JSON lines only)


def _reads_dataset(cfg: TrainConfig) -> List[str]:
    ds = cfg.dataset
    return [] if ds.paths or ds.sources or ds.use else [
        "dataset.paths: no data; give files or globs (or dataset.sources / dataset.use)"]


def _reads_shards(cfg: TrainConfig) -> List[str]:
    return [] if cfg.data.shard_dir else [
        "data.shard_dir: data=presharded needs the directory written by `dsrecipes shard`"]


RULES: Dict[DataKind, Rules] = {
    DataKind.map: Rules(_reads_dataset, prompt_rows=True, pairs=True, reference_cache=True),
    DataKind.iterable: Rules(_reads_dataset, pairs=True, parquet=False),  # its share: stream/shares.py
    DataKind.presharded: Rules(_reads_shards, lambda cfg: [("data.shard_dir", cfg.data.shard_dir)], reads_sources=False,
                               pairs=True, split_refusal=(
                                   "data=presharded reads parts written by `dsrecipes shard`; choose the share when "
                                   "sharding (dsrecipes shard ... dataset.split.take=NAME) and leave dataset.split "
                                   "unset here")),
}


def config_problems(cfg: TrainConfig) -> List[str]:
    rules = RULES[cfg.data.kind]
    split = [f"dataset.split: {rules.split_refusal}"] if rules.split_refusal and cfg.dataset.split.shares else []
    return rules.problems(cfg) + split


def required_paths(cfg: TrainConfig) -> List[NamedPath]:
    return RULES[cfg.data.kind].paths(cfg)


def reads_sources(cfg: TrainConfig) -> bool:
    return RULES[cfg.data.kind].reads_sources


def has_prompt_rows(cfg: TrainConfig) -> bool:
    return RULES[cfg.data.kind].prompt_rows


def carries_pairs(cfg: TrainConfig) -> bool:
    return RULES[cfg.data.kind].pairs


def caches_reference(cfg: TrainConfig) -> bool:
    return RULES[cfg.data.kind].reference_cache


def reads_parquet(cfg: TrainConfig) -> bool:
    return RULES[cfg.data.kind].parquet
