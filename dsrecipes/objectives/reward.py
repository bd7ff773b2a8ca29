"""`objective=reward`: a Bradley-Terry reward model on (prompt, chosen, rejected) pairs, as TRL's RewardTrainer.

The model is a sequence classifier with one label (modeling/model.py `scalar_head`): the base model's body and a
linear `score` head read at each sequence's last non-pad token (HF's `*ForSequenceClassification` pooling, by
`config.pad_token_id`). Batch layout: DPO's (objectives/dpo.py `collate_pairs`: the B chosen then the B rejected
right-padded sequences, `pair_mask`), plus `margin` when the rows carry one. With r = the score of prompt + answer:

  loss = mean over pairs of -log sigmoid(r_chosen - r_rejected - margin)
         + objective.center_rewards_coefficient x mean over pairs of (r_chosen + r_rejected)^2   (when set)

which is TRL 1.16 `RewardTrainer.compute_loss` (tests/test_reward.py compares them on the same weights and pairs).
Metrics are sums over pairs, reported as means: `reward_accuracy` (share of pairs with r_chosen > r_rejected),
`reward_margin` (mean r_chosen - r_rejected), `rewards_chosen`, `rewards_rejected`; evaluation adds `eval_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from dsrecipes.core.schema import ObjectiveKind, RowKind, TrainConfig
from dsrecipes.objectives.base import Batch, Row, pad_token_id
from dsrecipes.objectives.dpo import PerPairLoss, collate_pairs, placeholder_pair, reward_metrics

SUMS = ("pairs", "correct", "margin", "chosen_rewards", "rejected_rewards")


@dataclass
class Reward(PerPairLoss):
    pad_id: int
    center: Optional[float] = None  # objective.center_rewards_coefficient
    kind: ObjectiveKind = ObjectiveKind.reward
    step_tokens: bool = False  # a mean per micro-batch (objectives/base.py)
    row_kind: RowKind = RowKind.pair
    train_keys: Tuple[str, ...] = SUMS
    eval_keys: Tuple[str, ...] = ("loss_sum",) + SUMS

    def collate(self, rows: List[Row]) -> Batch:
        batch = collate_pairs(rows or [placeholder_pair(self.pad_id, False)], self.pad_id, real=bool(rows))
        if any(r.get("margin") is not None for r in rows):
            batch["margin"] = torch.tensor([float(r.get("margin") or 0.0) for r in rows], dtype=torch.float32)
        return batch

    def attach(self, cfg: TrainConfig, tokenizer: Any, engine: Any) -> None:
        """Nothing to attach: no reference model."""

    def metrics(self, sums: Dict[str, float], prefix: str) -> Dict[str, float]:
        return reward_metrics(sums, prefix)

    def pair_losses(self, model: Any, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """(loss of every pair, the micro-batch's metric sums): the centering term is per pair too, so that the
        mean over pairs is TRL's mean loss + coefficient x mean((r_chosen + r_rejected)^2)."""
        chosen, rejected = scores(model, batch, device).chunk(2)
        margin = batch["margin"].to(device) if "margin" in batch else torch.zeros_like(chosen)
        per_pair = -F.logsigmoid(chosen - rejected - margin)
        if self.center is not None:
            per_pair = per_pair + self.center * (chosen + rejected) ** 2
        mask = batch["pair_mask"].to(device)
        c, r = chosen.detach(), rejected.detach()
        sums = {"pairs": mask.sum(), "correct": ((c > r).float() * mask).sum(), "margin": ((c - r) * mask).sum(),
                "chosen_rewards": (c * mask).sum(), "rejected_rewards": (r * mask).sum()}
        return per_pair, sums


def build(cfg: TrainConfig, tokenizer: Any) -> Reward:
    return Reward(pad_token_id(tokenizer), cfg.objective.center_rewards_coefficient)


def scores(model: Any, batch: Batch, device: torch.device) -> torch.Tensor:
    """The scalar score of each of the batch's sequences (fp32), read by the model at its last non-pad token."""
    logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                   position_ids=batch["position_ids"].to(device), use_cache=False).logits
    return logits[:, 0].float()
