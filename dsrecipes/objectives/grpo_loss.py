"""The numbers of `objective=grpo`, as TRL 1.16's `GRPOTrainer` computes them (tests/test_grpo.py compares).

    group_advantages(rewards (B*G,), G) -> (advantages, group std)      TRL `_generate_and_score_completions`,
        scale_rewards="group" (its default): (r - group mean) / (group std + 1e-4), std unbiased (TRL `nanstd`)
    token_logps(logits, completion_ids, temperature) -> (B, T) log p(token) with logits / temperature (TRL
        `_get_per_token_logps_and_entropies`)
    grpo_loss(logps, old_logps, ref_logps, advantages, mask, epsilon, beta) -> (loss, mean KL per token)
        TRL `_compute_loss` with its default loss_type="dapo", importance_sampling_level="token", epsilon_low =
        epsilon_high = epsilon: ratio = exp(logp - old logp); per token -min(ratio A, clip(ratio, 1-eps, 1+eps) A),
        plus beta (exp(ref - logp) - (ref - logp) - 1) when beta > 0; the loss is the sum over completion tokens
        divided by the completion tokens of the whole generation batch (all processes and accumulation steps), as
        TRL: with objective.loss_average=tokens (the default) the loop samples a step's micro-batches before its
        first backward and passes `weight` (rank/step_tokens.py); with micro_batches each micro-batch is divided by
        its own tokens (README, "Token normalisation"; tests/test_grpo.py checks both with grad_accum 2).
With one optimisation step per generation (TRL's num_iterations=1), old logp = logp.detach(): the ratio is 1 and
the gradient is the advantage-weighted log-likelihood gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def group_advantages(rewards: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    std = (grouped.std(dim=1) if group > 1 else torch.zeros(grouped.shape[0])).repeat_interleave(group)
    return (rewards - mean) / (std + 1e-4), std


def token_logps(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    logps = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: Optional[torch.Tensor],
              advantages: torch.Tensor, mask: torch.Tensor, epsilon: float, beta: float,
              weight: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss, mean KL per completion token). The loss is the sum over completion tokens divided by their number, or
    times `weight` where given (the loop's `token_weight`: grad_accum x world over the whole step's tokens)."""
    adv = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = torch.zeros_like(logps)
    if beta != 0.0 and ref_logps is not None:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
    mask = mask.to(per_token.dtype)
    tokens = mask.sum().clamp(min=1.0)
    total = (per_token * mask).sum()
    return total / tokens if weight is None else total * weight, (kl.detach() * mask).sum() / tokens
