"""`objective=sft`: next-token cross-entropy on the trained spans of conversations.

Batch layout (`collate`). Right padding: `input_ids` with the tokenizer's pad id, `labels` with -100. Rows that pack
several samples get `attention_mask=None` and `position_ids` that restart at 0 per sample: transformers then builds
a per-sample causal (block-diagonal) mask from the position ids, which it only does when no attention mask is given
(`use_cache=False`). Padding positions restart at 0 too, so padding forms a block of its own and never mixes with a
real sample; with right padding and causal attention no real token sees it anyway. Batches whose rows each hold one
sample get an ordinary 0/1 `attention_mask`. An empty micro-batch (its samples were all dropped) becomes one pad
token that trains nothing, so every rank keeps the same number of forward/backward calls.

Loss. The cross-entropy summed over a micro-batch's predicted tokens (shifted labels != -100, packing boundaries
excluded: `token_sums`), divided by the number of predicted tokens of the whole optimizer step, on every rank
(`objective.loss_average=tokens`, the default: rank/step_tokens.py), or by the micro-batch's own (`micro_batches`).
Evaluation returns sums (loss sum, predicted tokens, tokens whose argmax is the label), reported as the
token-weighted `eval_loss`, `eval_ppl`, `eval_accuracy` and `eval_tokens` (`EvalResult`). With
`trainer.ce_chunk_tokens` > 0 the same sums come without the full-vocabulary logits (objectives/chunked_ce.py;
liger-kernel's fused linear cross-entropy for the training loss where installed, on CUDA); 0 takes them on the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from dsrecipes.core.schema import LossAverage, ObjectiveKind, RowKind, TrainConfig
from dsrecipes.objectives.base import IGNORE_INDEX, Batch, Row, pad_token_id
from dsrecipes.objectives.chunked_ce import fused_loss_sum, hidden_and_head, token_nll


@dataclass(frozen=True)
class EvalResult:
    """SFT's sums over every rank and micro-batch of one evaluation, as the logged numbers."""

    loss_sum: float
    tokens: int
    correct: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        try:
            return math.exp(self.loss)  # nan stays nan
        except OverflowError:
            return float("inf")

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens if self.tokens else float("nan")

    def metrics(self) -> Dict[str, float]:
        """The logged numbers (metrics.jsonl keys)."""
        return {"eval_loss": self.loss, "eval_ppl": self.perplexity, "eval_accuracy": self.accuracy,
                "eval_tokens": self.tokens}


@dataclass
class SFT:
    pad_id: int
    kind: ObjectiveKind = ObjectiveKind.sft
    row_kind: RowKind = RowKind.conversation
    train_keys: Tuple[str, ...] = ()
    eval_keys: Tuple[str, ...] = ("loss_sum", "tokens", "correct")
    chunk_tokens: int = 0  # trainer.ce_chunk_tokens (0: full logits)
    step_tokens: bool = True  # objective.loss_average=tokens: the loss is weighted by the step's token count

    def collate(self, rows: List[Row]) -> Batch:
        return collate(rows or [placeholder_row(self.pad_id)], self.pad_id)

    def tokens(self, model: Any, batch: Batch, device: torch.device) -> int:
        """The predicted tokens the micro-batch's loss counts (rank/step_tokens.py): known from its collation."""
        return int(batch["num_label_tokens"])

    def loss(self, model: Any, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, Dict[str, Any]]:
        weight = batch.get("token_weight")
        if weight is None:  # objective.loss_average=micro_batches (or a batch outside the loop: batch_probe.py)
            loss, _ = micro_batch_loss(model, batch, device, self.chunk_tokens)
            return loss, {}
        loss_sum, _ = batch_sums(model, batch, device, self.chunk_tokens)
        return loss_sum * weight, {}

    def eval_sums(self, model: Any, batch: Batch, device: torch.device) -> Dict[str, float]:
        loss_sum, tokens, correct = batch_sums(model, batch, device, self.chunk_tokens,
                                               count_correct=True)
        return {"loss_sum": float(loss_sum), "tokens": int(tokens), "correct": int(correct)}

    def attach(self, cfg: TrainConfig, tokenizer: Any, engine: Any) -> None:
        """Nothing to set up beside the engine."""

    def metrics(self, sums: Dict[str, float], prefix: str) -> Dict[str, float]:
        if prefix != "eval_":
            return {}
        return EvalResult(sums["loss_sum"], int(sums["tokens"]), int(sums["correct"])).metrics()


def build(cfg: TrainConfig, tokenizer: Any) -> SFT:
    return SFT(pad_token_id(tokenizer), chunk_tokens=cfg.trainer.ce_chunk_tokens,
               step_tokens=cfg.objective.loss_average is LossAverage.tokens)


def placeholder_row(pad_id: int) -> Row:
    """A one-token row that trains nothing (no sample id)."""
    return {"ids": [], "input_ids": [pad_id], "labels": [IGNORE_INDEX], "position_ids": [0]}


def is_packed(rows: Sequence[Mapping[str, Any]]) -> bool:
    """True when some row holds more than one sample."""
    return any(len(row["ids"]) > 1 for row in rows)


def collate(rows: Sequence[Mapping[str, Any]], pad_id: int, *, packing: Optional[bool] = None) -> Dict[str, Any]:
    """`rows`: prepared rows (`ids`, `input_ids`, `labels`, optional `position_ids`).

    Returns tensors `input_ids`, `labels`, `position_ids` (int64, [batch, longest row]), `attention_mask`
    (None when packing), plus `ids` (flat list of the sample ids in the batch), `num_tokens` (real tokens) and
    `num_label_tokens` (the predicted tokens the loss counts: `shifted_labels`). `packing=None` decides from the rows.
    """
    if not rows:
        raise ValueError("collate: empty batch")
    packed = is_packed(rows) if packing is None else packing
    width = max(len(row["input_ids"]) for row in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    attention_mask = None if packed else torch.zeros((n, width), dtype=torch.long)
    ids: List[str] = []
    num_tokens = 0
    for r, row in enumerate(rows):
        length = len(row["input_ids"])
        input_ids[r, :length] = torch.as_tensor(row["input_ids"], dtype=torch.long)
        labels[r, :length] = torch.as_tensor(row["labels"], dtype=torch.long)
        pos = row.get("position_ids")
        position_ids[r, :length] = torch.as_tensor(pos, dtype=torch.long) if pos is not None else torch.arange(length)
        position_ids[r, length:] = torch.arange(width - length)
        if attention_mask is not None:
            attention_mask[r, :length] = 1
        ids.extend(row["ids"])
        num_tokens += length
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "ids": ids,
        "num_tokens": num_tokens,
        "num_label_tokens": int((shifted_labels(labels, position_ids) != IGNORE_INDEX).sum()),
    }


def shifted_labels(labels: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """Token t predicts label t+1. Labels equal to -100 do not count, and neither does the first token of a packed
    sample (where `position_ids` restarts at 0): it must not be predicted from the end of the previous sample."""
    # Shift the labels left instead of slicing the logits: no copy of the (batch x length x vocab) tensor.
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if position_ids is not None:
        starts = torch.nn.functional.pad(position_ids[:, 1:] == 0, (0, 1), value=False)
        shift = shift.masked_fill(starts, IGNORE_INDEX)
    return shift


def token_sums(logits: torch.Tensor, labels: torch.Tensor, position_ids: Optional[torch.Tensor],
               count_correct: bool = False) -> Tuple[torch.Tensor, ...]:
    """(summed next-token cross-entropy, predicted tokens[, predicted tokens whose argmax is the label])."""
    shift = shifted_labels(labels, position_ids).to(logits.device)
    loss_sum = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), shift.reshape(-1),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")
    counted = shift != IGNORE_INDEX
    if not count_correct:
        return loss_sum, counted.sum()
    correct = ((logits.argmax(dim=-1) == shift) & counted).sum()
    return loss_sum, counted.sum(), correct


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor,
                   position_ids: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of predicted tokens (see `shifted_labels`)."""
    loss_sum, n = token_sums(logits, labels, position_ids)
    return loss_sum, n


def forward(model: Any, batch: Batch, device: torch.device) -> torch.Tensor:
    """Logits of one collated micro-batch. `model` is the DeepSpeed engine (or any module). `attention_mask` is
    None for packed rows, so transformers builds per-sample causal masks from the restarting `position_ids`."""
    attention_mask = batch["attention_mask"]
    outputs = model(
        input_ids=batch["input_ids"].to(device),
        position_ids=batch["position_ids"].to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        use_cache=False,
    )
    return outputs.logits


def model_inputs(batch: Batch, device: torch.device) -> Dict[str, Any]:
    attention_mask = batch["attention_mask"]
    return {"input_ids": batch["input_ids"].to(device), "position_ids": batch["position_ids"].to(device),
            "attention_mask": None if attention_mask is None else attention_mask.to(device)}


def batch_sums(model: Any, batch: Batch, device: torch.device, chunk_tokens: int = 0,
               count_correct: bool = False) -> Tuple[torch.Tensor, ...]:
    """`token_sums` of one collated micro-batch, with the full logits (`chunk_tokens=0`) or without (chunked_ce)."""
    labels, position_ids = batch["labels"].to(device), batch["position_ids"].to(device)
    if chunk_tokens <= 0:
        return token_sums(forward(model, batch, device), labels, position_ids, count_correct=count_correct)
    hidden, head = hidden_and_head(model, **model_inputs(batch, device))
    shift = shifted_labels(labels, position_ids)
    counted = (shift != IGNORE_INDEX).sum()
    fused = None
    if not count_correct and torch.is_grad_enabled():
        fused = fused_loss_sum(hidden, head, shift)
    if fused is not None:
        return fused, counted
    nll, correct = token_nll(hidden, head, shift, chunk_tokens, count_correct=count_correct)
    return (nll.sum(), counted) if correct is None else (nll.sum(), counted, correct.sum())


def micro_batch_loss(model: Any, batch: Batch, device: torch.device,
                     chunk_tokens: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(mean loss over the micro-batch's predicted tokens, token count) for one collated micro-batch."""
    loss_sum, n_tokens = batch_sums(model, batch, device, chunk_tokens)
    return loss_sum / n_tokens.clamp(min=1), n_tokens
