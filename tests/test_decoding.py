"""Exports decode the same through stock `pipeline` and `generate`: greedy written explicitly unless the base model
has its own sampling settings, which are kept (dsrecipes/data/render/decoding.py, called by serving.make_servable)."""

from __future__ import annotations

import json

import torch


def test_an_export_without_sampling_settings_is_greedy_through_pipeline_and_generate(tmp_path, make_cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.rank.export import export_initial

    cfg = make_cfg("debug=fast")
    out = export_initial(cfg, load_tokenizer(cfg), tmp_path / "export")
    saved = json.loads((out / "generation_config.json").read_text())
    assert saved["do_sample"] is False
    assert json.loads((out / "dsrecipes_export.json").read_text())["decoding"] == "greedy"
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    messages = [{"role": "user", "content": "Name three colours."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    direct = model.generate(**ids, max_new_tokens=12)[0, ids["input_ids"].shape[1]:]
    pipe = pipeline("text-generation", model=str(out), device="cpu")
    answers = []
    for seed in (1, 2):  # a sampling pipeline would answer differently under different seeds
        torch.manual_seed(seed)
        answers.append(pipe(messages, max_new_tokens=12)[0]["generated_text"][-1]["content"])
    assert answers[0] == answers[1] == tok.decode(direct, skip_special_tokens=True)


def test_a_base_model_that_samples_keeps_its_settings(tmp_path, make_cfg):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from dsrecipes.data.render.serving import make_servable
    from dsrecipes.modeling.model import build_tiny_model, load_tokenizer

    cfg = make_cfg("debug=fast")
    tok = load_tokenizer(cfg)
    model = build_tiny_model(cfg, tok)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=0)
    model.save_pretrained(tmp_path / "base")  # a base model published with its own sampling settings
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert make_servable(base, tok, cfg)["decoding"] == "sampling"
    base.save_pretrained(tmp_path / "served")
    gen = GenerationConfig.from_pretrained(tmp_path / "served")
    assert (gen.do_sample, gen.temperature, gen.top_p) == (True, 0.6, 0.9)
