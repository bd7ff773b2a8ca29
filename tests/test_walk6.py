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


# LLaMA-Factory's format_assistant (src/llamafactory/data/template.py): chatml's family writes "{{content}}<|im_end|>\n",
# alpaca "{{content}}", eos, "\n\n" (both: text after the end-of-turn token, trained with the reply); llama3
# "{{content}}<|eot_id|>", vicuna content + eos, empty "{{content}}": nothing after.
EOT_NEWLINE = ["qwen", "qwen3_nothink", "yi", "chatml_de", "dbrx", "opencoder", "alpaca"]


@pytest.mark.parametrize("name", [*EOT_NEWLINE, "chatml", "llama3", "vicuna", "empty", "default"])
def test_lf_templates_that_train_the_newline_after_the_end_of_turn_token_translate_to_train_eot_newline(name):
    import yaml

    from dsrecipes.config.flat_check import in_our_keys

    ours = yaml.safe_load(in_our_keys({"stage": "sft", "template": name}))
    wanted = name in EOT_NEWLINE or name == "chatml"  # LF's chatml is ours by name: kept, and its newline trained
    assert ours.get("template.train_eot_newline") is (True if wanted else None), ours


def test_a_translated_lf_qwen_file_trains_the_newline_after_im_end_as_llamafactory(tmp_path, make_cfg):
    """LF's qwen trains '<|im_end|>\\n' with every reply (its supervised processor: the assistant format is the
    target); the translated file trained '<|im_end|>' alone, one token fewer per reply."""
    from dsrecipes.config.flat_check import flat_problems, in_our_keys
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

    data = {"stage": "sft", "template": "qwen", "cutoff_len": 256}
    (line,) = [p for p in flat_problems(data, "lf.yaml", lambda _: None) if "template" in p]
    assert "template.train_eot_newline: true" in line, line
    recipe = tmp_path / "lf.yaml"
    recipe.write_text(in_our_keys(data))
    cfg = make_cfg(f"recipe={recipe}", check_files=False)
    tok = load_tokenizer(cfg)
    conv = Conversation("x", [Turn(Role.user, "q"), Turn(Role.assistant, "a"), Turn(Role.user, "r"),
                              Turn(Role.assistant, "b")])
    ex = Encoder(tok, cfg).encode(conv)
    end, (newline,) = tok.convert_tokens_to_ids("<|im_end|>"), tok("\n", add_special_tokens=False)["input_ids"]
    trained = [t for t in ex.labels if t != -100]
    ends = [i for i, t in enumerate(ex.input_ids) if t == end and ex.labels[i] == end]
    assert len(ends) == 2, tok.decode(trained)  # both replies' <|im_end|>
    assert [ex.labels[i + 1 : i + 2] for i in ends] == [[newline], [newline]], tok.decode(trained)
    assert tok.decode(trained).endswith("a<|im_end|>\nb<|im_end|>\n"), tok.decode(trained)
