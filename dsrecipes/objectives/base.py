"""The Objective contract: how prepared rows become a micro-batch, the loss the step trains on, and evaluation.

The training loop (train.py) and the loaders (data/strategies/) know nothing else about an objective:

    objective.attach(cfg, tokenizer, engine)
        once per rank after the DeepSpeed engine exists, before the first step (DPO with a live reference builds it).
    objective.collate(rows) -> batch
        rows: prepared rows of one micro-batch (possibly empty: every rank still runs the micro-batch, which then
        trains nothing). The batch is a dict of tensors plus `ids` (the sample ids it holds, for the ledger and
        `samples_seen`) and `num_tokens` (real input tokens, for tokens/s). Runs in DataLoader workers: an objective
        is small and picklable (no model, no tokenizer).
    objective.loss(model, batch, device) -> (loss, sums)
        loss: the scalar this rank back-propagates for the micro-batch (a mean; DeepSpeed divides it by grad_accum).
        An objective with `step_tokens` has `tokens(model, batch, device) -> int`, the tokens its loss counts,
        which the loop asks of every micro-batch of a step before the step's first backward (rank/step_tokens.py:
        SFT reads its collated count, GRPO samples the completions there); it then finds `batch["token_weight"]`
        and its loss is its sum over those tokens times that weight: each token of the step weighs the same.
        sums: {name: 0-dim tensor} for every name in `train_keys`: per-micro-batch SUMS (never means) of what the
        objective reports besides the loss, e.g. pairs and correctly ranked pairs. No device sync is needed.
    objective.eval_sums(model, batch, device) -> {name: float} for every name in `eval_keys`, again SUMS over the
        micro-batch (e.g. SFT: loss_sum, tokens, correct), so that any caller can add them over micro-batches and
        all-reduce them over ranks (SUM) before turning them into numbers with
    objective.metrics(sums, prefix) -> {prefix + metric: float}: the reported values (prefix "eval_" gives
        `eval_loss` first, the selection metric every objective has; prefix "" turns `train_keys` sums into train
        metrics, loss excluded: the loop averages micro-batch losses itself).

Rows, batches and sums are plain dicts: another objective on an existing row kind (ORPO on pairs) is one more
module, one option file and one `ObjectiveKind` value.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Tuple

from dsrecipes.core.schema import DpoLoss, ObjectiveKind, ReferenceMode, RowKind, TrainConfig

IGNORE_INDEX = -100  # the label of a token that is not trained: PyTorch cross-entropy's `ignore_index`

Row = Dict[str, Any]
Batch = Dict[str, Any]


class Objective(Protocol):
    kind: ObjectiveKind
    row_kind: RowKind  # the rows it trains on; its option file declares the same (`objective.rows`)
    train_keys: Tuple[str, ...]
    eval_keys: Tuple[str, ...]
    step_tokens: bool  # True: the loop asks each micro-batch's `tokens` and sets its `token_weight` for `loss`

    def collate(self, rows: List[Row]) -> Batch: ...

    def attach(self, cfg: Any, tokenizer: Any, engine: Any) -> None: ...

    def loss(self, model: Any, batch: Batch, device: Any) -> Tuple[Any, Dict[str, Any]]: ...

    def eval_sums(self, model: Any, batch: Batch, device: Any) -> Dict[str, float]: ...

    def metrics(self, sums: Dict[str, float], prefix: str) -> Dict[str, float]: ...


def pad_token_id(tokenizer: Any) -> int:
    """The id every batch pads with (model.load_tokenizer sets a pad token; eos where a tokenizer has none)."""
    pad = tokenizer.pad_token_id
    return tokenizer.eos_token_id if pad is None else pad


def ratio(num: float, den: float) -> float:
    """num / den, 0 for an empty denominator (a window or split with nothing in it)."""
    return float(num) / float(den) if den else 0.0


def reference_mode(cfg: TrainConfig) -> Optional[ReferenceMode]:
    """The reference model the run's objective compares with: `objective.reference` for DPO, None for SFT, ORPO and
    reference-free SimPO (then nothing computes, caches or loads a reference)."""
    o = cfg.objective
    if o.kind is not ObjectiveKind.dpo or o.loss is DpoLoss.simpo:
        return None
    return o.reference
