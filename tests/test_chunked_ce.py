"""Cross-entropy without full logits (objectives/chunked_ce.py) and padding-free packing, exact on CPU in fp32.

SFT's loss, its gradient and its eval sums, and the DPO family's answer log-probs and their gradient, are the same
with `trainer.cross_entropy=chunked` as with the full logits (rel 1e-5); two samples packed into one row without
padding (position_ids restarting, attention_mask None) give the losses they give alone, under sdpa and eager.
"""

from __future__ import annotations

import pytest
import torch

from dsrecipes.core.schema import TrainConfig
from dsrecipes.objectives import sft
from dsrecipes.objectives.base import IGNORE_INDEX
from dsrecipes.objectives.logps import sequence_logps

CPU = torch.device("cpu")


def tiny(attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    config._attn_implementation = attn
    return LlamaForCausalLM(config).float()


def sample(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (n,), generator=g).tolist()
    labels = [IGNORE_INDEX] * 3 + ids[3:]
    return {"ids": [f"s{seed}"], "input_ids": ids, "labels": labels, "position_ids": list(range(n))}


def packed(*samples):
    row = {"ids": [], "input_ids": [], "labels": [], "position_ids": []}
    for s in samples:
        row["ids"] += s["ids"]
        row["input_ids"] += s["input_ids"]
        row["labels"] += [IGNORE_INDEX] + s["labels"][1:]
        row["position_ids"] += s["position_ids"]
    return row


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Relative 1e-5 in norm (elementwise, entries near zero differ by fp32 rounding of a different sum order)."""
    return float((a - b).norm()) <= 1e-5 * max(float(a.norm()), 1e-12)


def sft_run(model, batch, how):
    model.zero_grad()
    loss, n = sft.micro_batch_loss(model, batch, CPU, how)
    loss.backward()
    return loss.detach(), n, grads(model)


def test_chunked_sft_loss_gradient_and_eval_sums_equal_full_logits():
    model = tiny()
    batch = sft.collate([packed(sample(20, 1), sample(13, 2)), sample(25, 3)], pad_id=0)
    full, n_full, g_full = sft_run(model, batch, 0)
    chunked, n_chunked, g_chunked = sft_run(model, batch, 7)
    assert int(n_full) == int(n_chunked) > 7 * 3 and close(full, chunked), (full, chunked)
    assert g_full.keys() == g_chunked.keys() and all(close(g_full[k], g_chunked[k]) for k in g_full)
    with torch.no_grad():
        a = sft.batch_sums(model, batch, CPU, 0, count_correct=True)
        b = sft.batch_sums(model, batch, CPU, 5, count_correct=True)
    assert close(a[0], b[0]) and int(a[1]) == int(b[1]) and int(a[2]) == int(b[2])


def test_chunked_dpo_logps_and_gradient_equal_full_logits():
    model = tiny()
    rows = [sample(18, 4), sample(11, 5), sample(15, 6), sample(9, 7)]
    batch = sft.collate(rows, pad_id=0)  # 2B sequences, right padded, with an attention mask
    out = {}
    for chunk in (0, 6):
        model.zero_grad()
        logps, tokens = sequence_logps(model, batch, CPU, chunk_tokens=chunk)
        (logps * torch.tensor([1.0, -0.5, 0.25, 2.0])).sum().backward()
        out[chunk] = (logps.detach(), tokens, grads(model))
    assert close(out[0][0], out[6][0]) and torch.equal(out[0][1], out[6][1])
    assert all(close(out[0][2][k], out[6][2][k]) for k in out[0][2])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_without_padding_equals_unpacked(attn):
    """One row holding two samples (no padding, no attention mask) gives each sample's loss alone: the attention
    implementation keeps them apart from the restarting position_ids."""
    model = tiny(attn)
    a, b = sample(17, 8), sample(12, 9)
    with torch.no_grad():
        together = sft.collate([packed(a, b)], pad_id=0)
        assert together["attention_mask"] is None
        loss_sum, n = sft.batch_sums(model, together, CPU)
        alone = [sft.batch_sums(model, sft.collate([s], pad_id=0), CPU) for s in (a, b)]
    assert int(n) == sum(int(x[1]) for x in alone)
    assert close(loss_sum, sum(x[0] for x in alone)), (loss_sum, alone)


def test_ce_chunk_tokens_is_validated():
    from dsrecipes.config.validate import validate

    cfg = TrainConfig()
    cfg.trainer.ce_chunk_tokens = -1
    assert [p for p in validate(cfg, check_files=False) if p.startswith("trainer.ce_chunk_tokens: must be >= 0")]
