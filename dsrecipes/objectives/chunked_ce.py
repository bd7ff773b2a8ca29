"""Next-token cross-entropy without the full-vocabulary logits in memory (`trainer.ce_chunk_tokens`); objectives/

`ce_chunk_tokens=0` (the default until a GPU measurement says otherwise): the model's own forward returns the
(batch x length x vocab) logits and the loss is taken on them (objectives/sft.py `token_sums`).

`ce_chunk_tokens=N`: the model is called with `logits_to_keep=1` (one position's logits) while a forward hook on its decoder
keeps the final hidden states; the output head then runs on `trainer.ce_chunk_tokens` predicted tokens at a time,
each chunk under activation checkpointing, so at most one chunk's logits (fp32) exist, in the forward and again in
the backward. Only positions whose shifted label counts are projected (prompt and padding positions cost nothing).
Pure torch: CPU and GPU, any ZeRO stage (the head is called as a module, so ZeRO-3 gathers its weight as usual).

With N > 0, SFT's training loss uses liger-kernel's fused linear cross-entropy instead where it is installed (an
optional extra), on CUDA, with the head's weight whole on the rank (not ZeRO-3 partitioned); else the chunks above.

Per-token negative log-likelihoods (`token_nll`) serve SFT's sums and the DPO family's answer log-probs alike.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dsrecipes.objectives.base import IGNORE_INDEX


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def hidden_and_head(model: Any, **inputs: Any) -> Tuple[torch.Tensor, torch.nn.Module]:
    """(final hidden states [batch, length, hidden], output head module) of one forward of `model` (a DeepSpeed
    engine, a PEFT model or a transformers causal LM) that computes a single position's logits."""
    hf = getattr(model, "module", model)
    decoder, head = hf.get_decoder(), hf.get_output_embeddings()
    kept = {}

    def keep(_module: Any, _args: Any, output: Any) -> None:
        kept["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = decoder.register_forward_hook(keep)
    try:
        model(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return kept["hidden"], head


def _chunk_nll(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="none")


def _chunk_correct(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return head(hidden).argmax(dim=-1) == targets


def token_nll(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk_tokens: int,
              count_correct: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token -log p(target) [batch, length] (0 where the target is -100) and, with `count_correct`, whether
    each counted token's argmax is its target. `targets` are already shifted (token t predicts targets[t])."""
    flat_targets = targets.reshape(-1).to(hidden.device)
    where = (flat_targets != IGNORE_INDEX).nonzero().squeeze(-1)
    rows = hidden.reshape(-1, hidden.size(-1)).index_select(0, where)
    picked = flat_targets.index_select(0, where)
    parts, correct_parts = [], []
    for start in range(0, rows.size(0), chunk_tokens):
        h, y = rows[start:start + chunk_tokens], picked[start:start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_nll, head, h, y, use_reentrant=False))
        else:
            parts.append(_chunk_nll(head, h, y))
        if count_correct:
            correct_parts.append(_chunk_correct(head, h, y))
    nll = torch.zeros(flat_targets.numel(), dtype=torch.float32, device=hidden.device)
    if parts:
        nll = nll.index_put((where,), torch.cat(parts))
    correct = None
    if count_correct:
        correct = torch.zeros(flat_targets.numel(), dtype=torch.bool, device=hidden.device)
        if correct_parts:
            correct = correct.index_put((where,), torch.cat(correct_parts))
        correct = correct.view_as(targets)
    return nll.view_as(targets), correct


def fused_loss_sum(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor) -> Optional[torch.Tensor]:
    """liger-kernel's fused linear cross-entropy summed over counted tokens, or None where it does not apply
    (not installed, not CUDA, a ZeRO-3 partitioned head weight, a head with a bias)."""
    weight = getattr(head, "weight", None)
    usable = (weight is not None and hidden.is_cuda and getattr(head, "bias", None) is None
              and not hasattr(weight, "ds_id") and liger_available())
    if not usable:
        return None
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # lazy: an optional extra, CUDA only

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
    return loss(weight, hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1).to(hidden.device))
