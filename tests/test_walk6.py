"""Sixth walkthrough: estimate's LoRA count under [all-linear]; LLaMA-Factory's chatml family trains the newline after
its end-of-turn token."""

from __future__ import annotations

import pytest

from dsrecipes.run import estimate as est

LLAMA_SEVEN = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def _lora(shape: est.ModelShape, base: est.ModelShape) -> int:
    return shape.total_params - base.total_params


def test_estimate_counts_all_linear_as_the_seven_llama_layers(make_cfg):
    """[all-linear] (peft: every linear layer but the output one) was looked up as a module name: 0 LoRA parameters."""
    def shape(*over: str) -> est.ModelShape:
        return est.model_shape(make_cfg(*over, check_files=False))

    base = shape()
    seven = shape("model.lora.enabled=true", f"model.lora.target_modules={LLAMA_SEVEN}")
    every = shape("model.lora.enabled=true", "model.lora.target_modules=[all-linear]")
    assert _lora(seven, base) > 0
    assert (every.total_params, every.trainable_params) == (seven.total_params, seven.trainable_params)


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])
def test_estimate_counts_all_linear_as_peft_adapts_it_on_other_architectures(make_cfg, tmp_path, arch):
    """On GPT-2 (Conv1D c_attn/c_proj/c_fc) and Phi-3 (qkv_proj, gate_up_proj) the Llama names do not all exist; the
    estimate's adapter parameters equal what peft's get_peft_model(target_modules="all-linear") adds."""
    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {"gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=128),
             "phi3": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, pad_token_id=0)}[arch]  # fmt: skip
    config = AutoConfig.for_model(arch, **small)
    config.save_pretrained(tmp_path)
    over = [f"model.path={tmp_path}", "model.lora.r=4"]
    base = est.model_shape(make_cfg(*over, check_files=False))
    lora = ["model.lora.enabled=true", "model.lora.target_modules=[all-linear]"]
    every = est.model_shape(make_cfg(*over, *lora, check_files=False))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert adapters > 0 and _lora(every, base) == adapters
    assert every.trainable_params == adapters  # only_optimize_lora: the adapters alone
