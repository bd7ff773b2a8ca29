"""collate(): padding, masks, ids and token counts; packed rows keep samples apart inside a real transformers model."""

from __future__ import annotations

import pytest

from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.packing import pack
from dsrecipes.data.render.tokenize import Example
from dsrecipes.objectives.sft import collate

PAD = 0


def row(ids, input_ids, labels, position_ids=None):
    r = {"ids": ids, "input_ids": input_ids, "labels": labels}
    if position_ids is not None:
        r["position_ids"] = position_ids
    return r


def test_unpacked_batch_pads_right_with_mask():
    b = collate([row(["a"], [5, 6, 7], [-100, 6, 7], [0, 1, 2]), row(["b"], [8, 9], [-100, 9])], PAD)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 9, PAD]]
    assert b["labels"].tolist() == [[-100, 6, 7], [-100, 9, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert b["ids"] == ["a", "b"] and b["num_tokens"] == 5 and b["num_label_tokens"] == 3


def test_packed_batch_has_no_attention_mask():
    b = collate([row(["a", "b"], [5, 6, 7, 8], [-100, 6, -100, 8], [0, 1, 0, 1]), row(["c"], [9], [-100], [0])], PAD)
    assert b["attention_mask"] is None and b["ids"] == ["a", "b", "c"]
    assert b["position_ids"].tolist() == [[0, 1, 0, 1], [0, 0, 1, 2]]  # padding restarts: a block of its own
    assert b["num_tokens"] == 5
    assert collate([row(["c"], [9], [-100], [0])], PAD, packing=True)["attention_mask"] is None
    with pytest.raises(ValueError):
        collate([], PAD)


@pytest.mark.slow  # importing the transformers model code alone takes seconds
def test_packed_rows_match_separate_samples_in_a_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    model.eval()
    examples = [Example("a", [3, 4, 5, 6, 7], [IGNORE_INDEX, 4, 5, 6, 7]), Example("b", [8, 9, 10], [IGNORE_INDEX, 9, 10])]
    packed = pack(examples, 16)
    assert len(packed) == 1
    p = packed[0]
    batch = collate([{"ids": p.ids, "input_ids": p.input_ids, "labels": p.labels, "position_ids": p.position_ids}], PAD)
    with torch.no_grad():
        together = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=None,
                         use_cache=False).logits[0]
        start = 0
        for ex in examples:
            alone = collate([{"ids": [ex.id], "input_ids": ex.input_ids, "labels": ex.labels}], PAD)
            logits = model(input_ids=alone["input_ids"], attention_mask=alone["attention_mask"], use_cache=False).logits[0]
            assert torch.allclose(together[start: start + len(ex.input_ids)], logits, atol=1e-5)
            start += len(ex.input_ids)
