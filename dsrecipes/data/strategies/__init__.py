"""Data strategies: one `DataStrategy` (protocol.py) per `DataKind`, looked up in `STRATEGIES`, and the dispatchers
the launching process (entry.py), the ranks (train.py) and `dsrecipes audit` call. Nothing outside this package
asks which data kind a run uses; the planner they share is `dsrecipes.data.plan.epoch`.

    strategy_of(cfg)                                                   -> DataStrategy
    plan_steps(cfg, world_size, prepared)                              -> (steps per epoch, total steps)
    build_loaders(cfg, tokenizer, rank, world_size, run_dir, plan)     -> (TrainLoader, EvalLoader | None)
    audit_config(cfg, world_size, epochs, num_rows)                    -> AuditReport

Guarantees, for every strategy, world size and `data.num_workers` (checked by `dsrecipes audit` and the tests):
1. within an epoch no sample is read twice across ranks and workers, and every sample is read except a remainder
   smaller than one global batch (world x micro_batch_size x grad_accum; presharded: per part, see presharded.py),
   which is the tail of the epoch's order and so changes between epochs when shuffling;
2. every rank runs exactly the same number of micro-batches, hence optimizer steps;
3. `state_dict()` resumes exactly, also under another world size or batch shape for map and iterable (elastic).

Adding a strategy is one module, one option file and one Enum value: write `data/strategies/<name>.py` with a class
implementing every method of `DataStrategy` (identity, prepare, steps_per_epoch, open, train_loader, eval_loader,
audit; its config rules go in `rules.py`'s table, checked by the same completeness test), add `<name>` to
`DataKind` in schema.py, add `conf/data/<name>.yaml`, and list the class in `STRATEGIES` below.
tests/test_strategy_table.py fails until every `DataKind` has a complete strategy, and refuses a `DataKind`
comparison in any module outside this package.

Imports: at module top, except the few marked `# lazy:` (the tokenizer stack: model.py imports torch). This package
is imported by the config validation (through rules.py), and `dsrecipes audit`/`validate` must not pay for torch.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from dsrecipes.core.runplan import RunPlan
from dsrecipes.core.schema import DataKind, TrainConfig
from dsrecipes.data.plan.epoch import Layout, total_steps
from dsrecipes.data.sources import remote
from dsrecipes.data.strategies.audit import AuditReport
from dsrecipes.data.strategies.base import TrainLoader
from dsrecipes.data.strategies.eval import EvalLoader
from dsrecipes.data.strategies.iterable import IterableStrategy
from dsrecipes.data.strategies.map import MapStrategy
from dsrecipes.data.strategies.presharded import PreshardedStrategy
from dsrecipes.data.strategies.protocol import DataStrategy, PrepareResult, RankData

STRATEGIES: Dict[DataKind, DataStrategy] = {s.kind: s for s in (MapStrategy(), IterableStrategy(), PreshardedStrategy())}

__all__ = ["STRATEGIES", "DataStrategy", "PrepareResult", "RankData", "audit_config", "build_loaders", "plan_steps",
           "strategy_of"]


def strategy_of(cfg: TrainConfig) -> DataStrategy:
    """The run's data strategy (every reader of a run comes through here: the store's read deadline is set)."""
    remote.configure(cfg.data.read_deadline_s)
    return STRATEGIES[cfg.data.kind]


def plan_steps(cfg: TrainConfig, world_size: int, prepared: PrepareResult) -> Tuple[Optional[int], int]:
    """(steps_per_epoch, total_steps) for a run, as every rank will execute it (DataError: an epoch has no step)."""
    per_epoch = strategy_of(cfg).steps_per_epoch(cfg, Layout.from_cfg(cfg, world_size), prepared)
    return per_epoch, total_steps(cfg, per_epoch)


def build_loaders(cfg: TrainConfig, tokenizer: Any, rank: int, world_size: int, run_dir: Any,
                  plan: RunPlan) -> Tuple[TrainLoader, Optional[EvalLoader]]:
    """A rank's train loader and its share of the validation rows (None: no validation data). What they read of the
    run directory (stream index, prepared data, manifest) is read and verified once, against `plan`."""
    strategy = strategy_of(cfg)
    source = strategy.open(cfg, str(run_dir), rank, world_size, plan)
    data = RankData(cfg, tokenizer, rank, world_size, str(run_dir), plan, source)
    return strategy.train_loader(data), strategy.eval_loader(data)


def audit_config(cfg: Any, world_size: int, epochs: int, num_rows: Optional[int] = None) -> AuditReport:
    """`dsrecipes audit`: the run's data plan for `world_size` ranks, checked over `epochs` epochs."""
    return strategy_of(cfg).audit(cfg, Layout.from_cfg(cfg, world_size), epochs, num_rows)
