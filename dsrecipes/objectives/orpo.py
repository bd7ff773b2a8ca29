"""`objective=orpo`: Odds Ratio Preference Optimization on (prompt, chosen, rejected) pairs, as TRL computes it.

No reference model: one model call per micro-batch over the DPO batch layout (objectives/dpo.py `collate_pairs`: the
B chosen then the B rejected sequences). With avg logp = the policy's log-probs averaged over an answer's tokens
(TRL's `average_log_prob=True`) and lambda = `objective.beta` (TRL's ORPOConfig.beta, default 0.1):

  log odds  = (avg chosen - avg rejected) - (log(1 - exp(avg chosen)) - log(1 - exp(avg rejected)))
  loss      = NLL(chosen) + lambda * mean over pairs of -log sigmoid(log odds)

NLL(chosen) is TRL's: the mean cross-entropy over every real token of the chosen sequences, prompt included (TRL's
`concatenated_forward`: "orpo chosen nll loss is computed over the full prompt and response"). tests/test_orpo.py
checks the loss against TRL's `ORPOTrainer.odds_ratio_loss` on the same log-probs. Metrics as TRL logs them:
rewards = lambda x avg logp, reward accuracy, margin, `nll_loss`, `log_odds_ratio` (mean log sigmoid(log odds)),
`log_odds_chosen` (mean log odds); all kept as sums over pairs (and NLL over tokens) so they add over micro-batches
and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

from dsrecipes.core.schema import ObjectiveKind, RowKind, TrainConfig
from dsrecipes.objectives.base import IGNORE_INDEX, Batch, Row, pad_token_id, ratio
from dsrecipes.objectives.dpo import collate_pairs, placeholder_pair

AVG_MAX = -1e-6  # an answer's average log-prob is kept below 0, where log(1 - exp(x)) is finite (a placeholder pair's is 0)
SUMS = ("pairs", "nll_sum", "nll_tokens", "ratio_sum", "log_odds", "chosen_rewards", "rejected_rewards", "correct",
        "chosen_logps", "rejected_logps")


@dataclass
class ORPO:
    pad_id: int
    beta: float  # lambda: the weight of the odds-ratio term
    kind: ObjectiveKind = ObjectiveKind.orpo
    step_tokens: bool = False  # a mean per micro-batch (objectives/base.py)
    row_kind: RowKind = RowKind.pair
    train_keys: Tuple[str, ...] = SUMS
    eval_keys: Tuple[str, ...] = SUMS

    def collate(self, rows: List[Row]) -> Batch:
        return collate_pairs(rows or [placeholder_pair(self.pad_id, False)], self.pad_id, real=bool(rows))

    def attach(self, cfg: TrainConfig, tokenizer: Any, engine: Any) -> None:
        """Nothing to attach: ORPO has no reference model."""

    def loss(self, model: Any, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, Dict[str, Any]]:
        sums = self.sums(model, batch, device)
        nll = sums["nll_sum"] / sums["nll_tokens"].clamp(min=1)
        loss = nll - self.beta * sums["ratio_sum"] / sums["pairs"].clamp(min=1)
        return loss, {k: v.detach() for k, v in sums.items()}

    def eval_sums(self, model: Any, batch: Batch, device: torch.device) -> Dict[str, float]:
        return {k: float(v) for k, v in self.sums(model, batch, device).items()}

    def metrics(self, sums: Dict[str, float], prefix: str) -> Dict[str, float]:
        n = sums["pairs"]
        nll = ratio(sums["nll_sum"], sums["nll_tokens"])
        out = {"eval_loss": nll - self.beta * ratio(sums["ratio_sum"], n)} if prefix == "eval_" else {}
        out.update({
            f"{prefix}nll_loss": nll,
            f"{prefix}log_odds_ratio": ratio(sums["ratio_sum"], n),
            f"{prefix}log_odds_chosen": ratio(sums["log_odds"], n),
            f"{prefix}rewards_chosen": ratio(sums["chosen_rewards"], n),
            f"{prefix}rewards_rejected": ratio(sums["rejected_rewards"], n),
            f"{prefix}reward_accuracy": ratio(sums["correct"], n),
            f"{prefix}reward_margin": ratio(sums["chosen_rewards"] - sums["rejected_rewards"], n),
            f"{prefix}logps_chosen": ratio(sums["chosen_logps"], n),
            f"{prefix}logps_rejected": ratio(sums["rejected_logps"], n),
        })
        return out

    def sums(self, model: Any, batch: Batch, device: torch.device) -> Dict[str, torch.Tensor]:
        """The micro-batch's sums (module docstring); `nll_sum` and `ratio_sum` carry the gradient."""
        per_token, answer, seen = token_logps(model, batch, device)
        mask = batch["pair_mask"].to(device)
        avg = ((per_token * answer).sum(dim=1) / answer.sum(dim=1).clamp(min=1)).clamp(max=AVG_MAX)
        chosen, rejected = avg.chunk(2)
        log_odds, log_ratio = odds_ratio(chosen, rejected)
        chosen_seen = seen.chunk(2)[0] * mask[:, None]
        c_rew, r_rew = self.beta * chosen.detach(), self.beta * rejected.detach()
        return {"pairs": mask.sum(), "nll_sum": -(per_token.chunk(2)[0] * chosen_seen).sum(),
                "nll_tokens": chosen_seen.sum(), "ratio_sum": (log_ratio * mask).sum(),
                "log_odds": (log_odds.detach() * mask).sum(), "chosen_rewards": (c_rew * mask).sum(),
                "rejected_rewards": (r_rew * mask).sum(), "correct": ((c_rew > r_rew).float() * mask).sum(),
                "chosen_logps": (chosen.detach() * mask).sum(), "rejected_logps": (rejected.detach() * mask).sum()}


def build(cfg: TrainConfig, tokenizer: Any) -> ORPO:
    return ORPO(pad_token_id(tokenizer), cfg.objective.beta)


def token_logps(model: Any, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p of every next token, answer-token mask, real-token mask) of the 2B sequences, all shifted by one."""
    logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                   position_ids=batch["position_ids"].to(device), use_cache=False).logits[:, :-1].float()
    targets = batch["input_ids"].to(device)[:, 1:]
    picked = torch.gather(logits, 2, targets.unsqueeze(-1)).squeeze(-1)
    answer = (batch["labels"].to(device)[:, 1:] != IGNORE_INDEX).float()
    seen = batch["attention_mask"].to(device)[:, 1:].float()
    return (picked - torch.logsumexp(logits, dim=-1)) * seen, answer, seen


def odds_ratio(chosen: torch.Tensor, rejected: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log odds, log sigmoid(log odds)) per pair from the answers' average log-probs (TRL's `odds_ratio_loss`,
    its numerically stable log(1 - exp(x)) included)."""
    chosen, rejected = chosen.float(), rejected.float()
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return log_odds, F.logsigmoid(log_odds)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, branching at -ln 2 to avoid cancellation (as TRL)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))
