"""`objective=dpo`: Direct Preference Optimization on (prompt, chosen, rejected) pairs, as TRL computes it.

Batch layout (`collate`): a micro-batch of B pairs is 2B right-padded sequences, the B chosen (prompt + chosen
answer) then the B rejected, with `labels` = the answer's tokens (-100 on the prompt and padding), an ordinary
attention mask, `pair_mask` (1 per real pair; an empty micro-batch is one placeholder pair of weight 0), and, when
the rows carry them (`objective.reference=precomputed`), the reference log-probs `ref_chosen_logps` /
`ref_rejected_logps`.

Numbers (tests/test_dpo.py checks them against TRL's DPOTrainer, SimPO against its CPOTrainer): logp(answer) = the sum over the answer's tokens of
log p(token | everything before it); log-ratios against the reference; delta = chosen log-ratio - rejected
log-ratio; loss per pair:
  sigmoid  -(1 - ls) log sigmoid(beta delta) - ls log sigmoid(-beta delta)   (ls = objective.label_smoothing: cDPO)
  robust   (-(1 - ls) log sigmoid(beta delta) + ls log sigmoid(-beta delta)) / (1 - 2 ls)
  ipo      (chosen log-ratio / chosen tokens - rejected log-ratio / rejected tokens - 1 / (2 beta))^2
  simpo    -(1 - ls) log sigmoid(beta delta - gamma) - ls log sigmoid(gamma - beta delta)   (gamma =
           objective.simpo_gamma) with NO reference: the "log-ratios" are the policy's log-probs averaged per answer
           token (length-normalised), as TRL's CPOTrainer(loss_type="simpo", cpo_alpha=0) computes them; logps and
           rewards report those averages
The micro-batch loss is the mean over its pairs. rewards = beta x log-ratio; reward accuracy = share of pairs with
chosen reward > rejected reward; margin = chosen - rejected reward. Train metrics and evaluation are sums over pairs
(`train_keys`, `eval_keys`), reported as means per pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from dsrecipes.core.schema import DpoLoss, ObjectiveKind, ReferenceMode, RowKind, TrainConfig
from dsrecipes.objectives.base import IGNORE_INDEX, Batch, Row, pad_token_id, ratio, reference_mode
from dsrecipes.objectives.dpo_live import Reference, live_reference
from dsrecipes.objectives.logps import sequence_logps

PAIR_SUMS = ("pairs", "chosen_rewards", "rejected_rewards", "correct", "margin", "chosen_logps", "rejected_logps")


class PerPairLoss:
    """The loss and evaluation sums of an objective whose `pair_losses` gives one loss per pair (the DPO family,
    reward models): the mean over the micro-batch's real pairs, and their sum for evaluation."""

    def loss(self, model: Any, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, Dict[str, Any]]:
        per_pair, sums = self.pair_losses(model, batch, device)
        mask = batch["pair_mask"].to(device)
        return (per_pair * mask).sum() / mask.sum().clamp(min=1), sums

    def eval_sums(self, model: Any, batch: Batch, device: torch.device) -> Dict[str, float]:
        per_pair, sums = self.pair_losses(model, batch, device)
        out = {k: float(v) for k, v in sums.items()}
        out["loss_sum"] = float((per_pair * batch["pair_mask"].to(device)).sum())
        return out


def reward_metrics(sums: Dict[str, float], prefix: str) -> Dict[str, float]:
    """eval_loss (evaluation only) and the rewards of chosen and rejected answers, their accuracy and margin."""
    n = sums["pairs"]
    out = {"eval_loss": ratio(sums["loss_sum"], n)} if prefix == "eval_" else {}
    out.update({
        f"{prefix}rewards_chosen": ratio(sums["chosen_rewards"], n),
        f"{prefix}rewards_rejected": ratio(sums["rejected_rewards"], n),
        f"{prefix}reward_accuracy": ratio(sums["correct"], n),
        f"{prefix}reward_margin": ratio(sums["margin"], n),
    })
    return out


@dataclass
class DPO(PerPairLoss):
    pad_id: int
    beta: float
    loss_kind: DpoLoss
    label_smoothing: float
    gamma: float = 0.0  # objective.simpo_gamma (loss=simpo)
    kind: ObjectiveKind = ObjectiveKind.dpo
    step_tokens: bool = False  # a mean per micro-batch (objectives/base.py)
    row_kind: RowKind = RowKind.pair
    train_keys: Tuple[str, ...] = PAIR_SUMS
    eval_keys: Tuple[str, ...] = ("loss_sum",) + PAIR_SUMS
    precomputed: bool = True  # the rows carry the reference log-probs (objective.reference=precomputed)
    reference: Optional[Reference] = None  # live reference (train.py sets it)
    chunk_tokens: int = 0  # trainer.ce_chunk_tokens > 0: policy log-probs without full logits (chunked_ce)

    def collate(self, rows: List[Row]) -> Batch:
        return collate_pairs(rows or [placeholder_pair(self.pad_id, self.precomputed)], self.pad_id, real=bool(rows))

    def metrics(self, sums: Dict[str, float], prefix: str) -> Dict[str, float]:
        out = reward_metrics(sums, prefix)
        out.update({f"{prefix}logps_chosen": ratio(sums["chosen_logps"], sums["pairs"]),
                    f"{prefix}logps_rejected": ratio(sums["rejected_logps"], sums["pairs"])})
        return out

    def pair_losses(self, model: Any, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """(loss of every pair, the micro-batch's metric sums) with the policy `model`."""
        logps, tokens = sequence_logps(model, batch, device, self.chunk_tokens)
        if self.loss_kind is DpoLoss.simpo:  # length-normalised: the average log-prob per answer token
            logps = logps / tokens.clamp(min=1)
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = self.reference_logps(batch, device)
        per_pair = dpo_loss(chosen - ref_chosen, rejected - ref_rejected, tokens.chunk(2), self.beta,
                            self.loss_kind, self.label_smoothing, self.gamma)
        mask = batch["pair_mask"].to(device)
        c_rew = self.beta * (chosen - ref_chosen).detach()
        r_rew = self.beta * (rejected - ref_rejected).detach()
        sums = {"pairs": mask.sum(), "chosen_rewards": (c_rew * mask).sum(), "rejected_rewards": (r_rew * mask).sum(),
                "correct": ((c_rew > r_rew).float() * mask).sum(), "margin": ((c_rew - r_rew) * mask).sum(),
                "chosen_logps": (chosen.detach() * mask).sum(), "rejected_logps": (rejected.detach() * mask).sum()}
        return per_pair, sums

    def attach(self, cfg: TrainConfig, tokenizer: Any, engine: Any) -> None:
        """objective.reference=live: build the live reference (objectives/dpo_live.py); nothing otherwise."""
        if reference_mode(cfg) is ReferenceMode.live:
            self.reference = live_reference(cfg, tokenizer, engine)

    def reference_logps(self, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.loss_kind is DpoLoss.simpo:  # reference-free: the log-ratios are the policy's own log-probs
            zeros = torch.zeros(batch["pair_mask"].shape, device=device)
            return zeros, zeros
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"].to(device), batch["ref_rejected_logps"].to(device)
        if self.reference is None:
            raise RuntimeError("objective=dpo: the batch has no reference log-probs and no live reference is set")
        return self.reference(batch, device)


def build(cfg: TrainConfig, tokenizer: Any) -> DPO:
    o = cfg.objective
    return DPO(pad_token_id(tokenizer), o.beta, o.loss, o.label_smoothing, gamma=o.simpo_gamma,
               precomputed=reference_mode(cfg) is ReferenceMode.precomputed,
               chunk_tokens=cfg.trainer.ce_chunk_tokens)


def dpo_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor,
             tokens: Tuple[torch.Tensor, torch.Tensor], beta: float, kind: DpoLoss, ls: float,
             gamma: float = 0.0) -> torch.Tensor:
    """The loss of every pair (see the module docstring); `tokens`: answer tokens of (chosen, rejected); simpo:
    the log-ratios are the policy's per-token average log-probs, `gamma` the target margin."""
    delta = chosen_logratios - rejected_logratios
    if kind is DpoLoss.simpo:
        return -(1 - ls) * F.logsigmoid(beta * delta - gamma) - ls * F.logsigmoid(gamma - beta * delta)
    if kind is DpoLoss.sigmoid:
        return -(1 - ls) * F.logsigmoid(beta * delta) - ls * F.logsigmoid(-beta * delta)
    if kind is DpoLoss.robust:
        return (-(1 - ls) * F.logsigmoid(beta * delta) + ls * F.logsigmoid(-beta * delta)) / (1 - 2 * ls)
    chosen_tokens, rejected_tokens = (t.clamp(min=1) for t in tokens)
    return (chosen_logratios / chosen_tokens - rejected_logratios / rejected_tokens - 1 / (2 * beta)) ** 2


def placeholder_pair(pad_id: int, precomputed: bool) -> Row:
    """A pair that trains nothing (no sample id; weight 0 in the loss)."""
    row = {"ids": [], "prompt_ids": [pad_id], "chosen_ids": [pad_id], "chosen_labels": [IGNORE_INDEX],
           "rejected_ids": [pad_id], "rejected_labels": [IGNORE_INDEX]}
    if precomputed:
        row.update(ref_chosen_logps=0.0, ref_rejected_logps=0.0)
    return row


def collate_pairs(rows: List[Row], pad_id: int, real: bool = True) -> Batch:
    """B pairs -> 2B sequences (chosen first); see the module docstring."""
    seqs = [(r["prompt_ids"], r[f"{side}_ids"], r[f"{side}_labels"]) for side in ("chosen", "rejected") for r in rows]
    width = max(len(p) + len(a) for p, a, _ in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    for i, (prompt, answer, answer_labels) in enumerate(seqs):
        length = len(prompt) + len(answer)
        input_ids[i, :length] = torch.as_tensor(list(prompt) + list(answer), dtype=torch.long)
        labels[i, len(prompt):length] = torch.as_tensor(list(answer_labels), dtype=torch.long)
        attention_mask[i, :length] = 1
    batch: Batch = {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": torch.arange(width).repeat(n, 1),
        "pair_mask": torch.full((len(rows),), 1.0 if real else 0.0),
        "ids": [i for r in rows for i in r["ids"]],
        "num_tokens": int(attention_mask.sum()),
    }
    if "ref_chosen_logps" in rows[0]:
        batch["ref_chosen_logps"] = torch.tensor([float(r["ref_chosen_logps"]) for r in rows], dtype=torch.float32)
        batch["ref_rejected_logps"] = torch.tensor([float(r["ref_rejected_logps"]) for r in rows], dtype=torch.float32)
    return batch
