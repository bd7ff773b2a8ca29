"""The `DataStrategy` contract: everything the launching process, the ranks and `dsrecipes audit` ask of a data
strategy, implemented once per `DataKind` (map.py, iterable.py, presharded.py) and looked up in `STRATEGIES`.

Launching process (entry.py), in this order:
    identity(cfg, tokenizer)            -> (fingerprint, {file: content hash}): read-only, for the resume contract
    prepare(cfg, run_dir, tokenizer, world_size) -> PrepareResult: all of the strategy's I/O before any rank starts
    steps_per_epoch(cfg, layout, prepared) -> optimizer steps per epoch: arithmetic on what `prepare` found
Each rank (train.py), with the plan it read once:
    open(cfg, run_dir, rank, world_size, plan) -> what the rank reads (index, prepared data, manifest), read once
    train_loader(data: RankData)        -> TrainLoader
    eval_loader(data: RankData)         -> EvalLoader or None (no validation data)
`dsrecipes audit`: audit(cfg, layout, epochs, num_rows) -> AuditReport.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Protocol, Tuple

from dsrecipes.core.errors import DataError
from dsrecipes.core.runplan import PLAN_FILE, RunPlan
from dsrecipes.core.schema import DataKind, TrainConfig

if TYPE_CHECKING:
    from dsrecipes.data.plan.epoch import Layout
    from dsrecipes.data.strategies.audit import AuditReport
    from dsrecipes.data.strategies.base import TrainLoader
    from dsrecipes.data.strategies.eval import EvalLoader


@dataclass(frozen=True)
class PrepareResult:
    """What the launching process found while preparing: recorded in plan.json and used for the step count."""

    rows: Optional[int]  # training samples (rows) of one epoch; None: a stream of unknown length
    fingerprint: str  # the data identity after preparing; must still be what `identity` returned
    val_rows: int = 0  # validation samples the ranks will evaluate (0: the run does not evaluate)
    detail: Any = None  # strategy-private (presharded: the part counts)
    files: Optional[Dict[str, str]] = None  # {training file: content hash} from preparing (`identity_in_prepare`)


@dataclass
class RankData:
    """One rank's inputs: the run plan and what `open` read (once), shared by its train and eval loaders."""

    cfg: TrainConfig
    tokenizer: Any
    rank: int
    world_size: int
    run_dir: str
    plan: RunPlan
    source: Any  # what the strategy's `open` returned


class DataStrategy(Protocol):
    """One data strategy. `needs_tokenizer`: the launching process loads the tokenizer before `identity`
    (map: the preparation cache key hashes it)."""

    kind: DataKind
    needs_tokenizer: bool
    # a fresh start (no checkpoint to check against) takes its identity from `prepare`, which hashes the files in
    # the pass that reads them anyway (data=iterable: one read of a local corpus on the launching side, cold)
    identity_in_prepare: bool = False
    # the run reads the dataset's sources itself, so its config (dataset.split, pins) says which rows it trains on;
    # presharded reads the parts `dsrecipes shard` wrote, whose share is recorded nowhere (audit_pipeline.py)
    reads_sources: bool = True

    def identity(self, cfg: TrainConfig, tokenizer: Any) -> Tuple[str, Dict[str, str]]:
        """(fingerprint, {training file: content hash}) without writing anything."""
        ...

    def prepare(self, cfg: TrainConfig, run_dir: Path, tokenizer: Any, world_size: int) -> PrepareResult:
        """The launching process's part: prepare, index or check the data; bad rows fail here."""
        ...

    def steps_per_epoch(self, cfg: TrainConfig, layout: "Layout", prepared: PrepareResult) -> Optional[int]:
        """Optimizer steps per epoch, equal on every rank (DataError when an epoch has none)."""
        ...

    def open(self, cfg: TrainConfig, run_dir: str, rank: int, world_size: int, plan: RunPlan) -> Any:
        """What a rank reads of the run directory and the data, verified against `plan`, once."""
        ...

    def train_loader(self, data: RankData) -> "TrainLoader":
        ...

    def eval_loader(self, data: RankData) -> Optional["EvalLoader"]:
        """This rank's share of the validation rows; None when the run has none."""
        ...

    def audit(self, cfg: TrainConfig, layout: "Layout", epochs: int, num_rows: Optional[int]) -> "AuditReport":
        """The data plan of every rank and worker, checked (`dsrecipes audit`)."""
        ...


def rows_of_plan(plan: RunPlan, planned: int, run_dir: str) -> None:
    """A rank's count of an epoch's samples must be the one the launching process planned."""
    if plan.rows is not None and plan.rows != planned:
        raise DataError(f"{run_dir}/{PLAN_FILE} plans {plan.rows} samples per epoch, this rank's data has "
                        f"{planned}: the data changed since the launching process planned the run; start it again")
