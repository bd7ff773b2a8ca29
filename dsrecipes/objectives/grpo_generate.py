"""Sampling the completions of `objective=grpo` with the policy, reproducibly: every completion has its own seed.

    sample(model, prompt_ids, prompt_mask, seeds, max_new, temperature, stop_ids, pad_id) -> (ids, mask)

`prompt_ids` are LEFT-padded (B, P); each row is sampled with a `torch.Generator` seeded by `seeds[i]`, so a
completion depends on its prompt, its seed and the weights only - not on the other rows of the micro-batch, the
rank, or the worker - and a resumed run samples exactly what the interrupted one would have. The seed of
completion j of a prompt is `completion_seed(seed, epoch, its position key, j)` (grpo.seed_keys). With `group` completions per prompt the prompt is read once and its
cache repeated (the prompt forward is most of the sampling cost).

A completion ends at its first stop token (kept: the end of the turn is part of the answer) or after `max_new`
tokens; after it, `mask` is 0 and the ids are the pad id. ZeRO-3: the caller gathers the parameters around this
(`gathered`), as DeepSpeed-Chat's hybrid engine does for generation, and every rank runs all `max_new` forwards
(a rank whose completions ended early would otherwise leave the others' collectives waiting).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Iterator, List, Sequence, Tuple

import torch


def completion_seed(seed: int, epoch: int, key: str, j: int) -> int:
    """A 63-bit seed from (trainer.seed, epoch, the prompt's position key, completion index): the same wherever the
    sample trains."""
    digest = hashlib.blake2b(f"{seed}|{epoch}|{key}|{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[bool]:
    """ZeRO-3: every partitioned parameter gathered for the duration (read only); nothing otherwise. Yields whether
    the model is partitioned."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield False
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield True


@torch.no_grad()
def sample(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: Sequence[int],
           max_new: int, temperature: float, stop_ids: Sequence[int], pad_id: int, stop_early: bool = True,
           group: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """(completion ids (B * group, T), completion mask (B * group, T)), T <= max_new; see the module docstring.
    `group` completions per prompt row (seeds: B * group, in row order): each prompt is read once and its cache
    repeated. `stop_early=False` runs all max_new forwards even when every row has ended (ZeRO-3: the ranks'
    forwards stay in step)."""
    device = prompt_ids.device
    gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    past, logits = out.cache, out.logits[:, -1, :]
    if group > 1:
        past, logits = _repeated(model, prompt_ids, prompt_mask, positions, past, logits, group)
    mask, positions = prompt_mask.repeat_interleave(group, dim=0), positions.repeat_interleave(group, dim=0)
    b = mask.shape[0]
    stops = torch.tensor(list(stop_ids), device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    tokens: List[torch.Tensor] = []
    alive: List[torch.Tensor] = []
    next_pos = positions[:, -1] + 1
    for _ in range(max_new):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        picked = torch.cat([torch.multinomial(probs[i], 1, generator=gens[i]) for i in range(b)])
        picked = torch.where(done, torch.full_like(picked, pad_id), picked)
        tokens.append(picked)
        alive.append(~done)
        done = done | torch.isin(picked, stops)
        if stop_early and bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(input_ids=picked[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    cache=past, use_cache=True)
        past, logits, next_pos = out.cache, out.logits[:, -1, :], next_pos + 1
    return torch.stack(tokens, dim=1), torch.stack(alive, dim=1).long()


def _repeated(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor,
              past: Any, logits: torch.Tensor, group: int) -> Tuple[Any, torch.Tensor]:
    """The prompt cache and last logits repeated `group` times per row (a cache whose layers cannot repeat: the
    repeated prompts are read again)."""
    layers = getattr(past, "layers", None)
    if layers and all(hasattr(layer, "batch_repeat_interleave") for layer in layers):
        for layer in layers:
            layer.batch_repeat_interleave(group)
        return past, logits.repeat_interleave(group, dim=0)
    out = model(input_ids=prompt_ids.repeat_interleave(group, dim=0), attention_mask=prompt_mask.repeat_interleave(
        group, dim=0), position_ids=positions.repeat_interleave(group, dim=0), use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[:, -1, :]


def stop_ids(tokenizer: Any) -> List[int]:
    """The tokens that end a completion: eos and the template's end-of-turn token where the tokenizer has one."""
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
        got = tokenizer.convert_tokens_to_ids(token)
        if isinstance(got, int) and got != tokenizer.unk_token_id and got is not None:
            ids.add(got)
    return sorted(i for i in ids if i is not None)
