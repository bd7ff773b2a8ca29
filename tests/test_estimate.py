"""estimate: model-state memory equals DeepSpeed's own estimators; shapes from meta models; the CLI table."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from deepspeed.runtime.zero.stage3 import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
)
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from dsrecipes.commands.estimate import main as estimate_main
from dsrecipes.run import estimate as est

P, L = 1_234_567_890, 123_456_789
LAYOUTS = [(1, 1), (8, 1), (8, 4), (4, 2)]


@pytest.fixture
def mixed_adam(make_cfg):
    return make_cfg("precision=bf16", "optimizer=adamw", check_files=False)


def shape(total=P, trainable=P, largest=L):
    return est.ModelShape(total_params=total, trainable_params=trainable, largest_layer_params=largest)


@pytest.mark.parametrize("gpn,nodes", LAYOUTS)
def test_zero2_matches_deepspeed(mixed_adam, gpn, nodes):
    for offload in (False, True):
        ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(P, gpn, nodes, cpu_offload=offload)
        gpu, cpu = est.model_states(2, offload, False, shape(), mixed_adam, gpn, nodes, zero_init=False)
        assert (int(gpu), int(cpu)) == (ds_gpu, ds_cpu), offload


@pytest.mark.parametrize("gpn,nodes", LAYOUTS)
@pytest.mark.parametrize("zero_init", [True, False])
def test_zero3_matches_deepspeed(mixed_adam, gpn, nodes, zero_init):
    for opt_off, param_off in ((False, False), (True, False), (True, True)):
        ds_cpu, ds_gpu, _ = estimate_zero3_model_states_mem_needs(
            P, L, gpn, nodes, cpu_offload=opt_off, cpu_offload_params=param_off, zero_init=zero_init
        )
        gpu, cpu = est.model_states(3, opt_off, param_off, shape(), mixed_adam, gpn, nodes, zero_init=zero_init)
        assert (int(gpu), int(cpu)) == (ds_gpu, ds_cpu), (opt_off, param_off)


def test_numbers_appear_in_deepspeeds_printed_table(mixed_adam):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        estimate_zero3_model_states_mem_needs_all_cold(P, L, 8, 2)
    (line,) = [
        ln
        for ln in out.getvalue().splitlines()
        if "offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1" in ln
    ]
    cpu_text, gpu_text = [cell.strip() for cell in line.split("|")[:2]]
    gpu, cpu = est.model_states(3, True, False, shape(), mixed_adam, 8, 2, zero_init=True)
    assert (f"{cpu / 2**30:.2f}GB", f"{gpu / 2**30:.2f}GB") == (cpu_text, gpu_text)


def test_stage_ordering_and_lora_and_fp32(make_cfg, mixed_adam):
    gpus = [est.model_states(s, o, p, shape(), mixed_adam, 8, 1, False)[0] for s, _, o, p in est.OPTIONS]
    by = dict(zip([(s, n) for s, n, _, _ in est.OPTIONS], gpus, strict=True))
    assert by[(0, "none")] > by[(1, "none")] > by[(2, "none")] > by[(3, "none")] > by[(3, "optimizer=cpu,param=cpu")]
    assert by[(0, "none")] == 2 * P + 18 * P  # DeepSpeed's 2 + 18 bytes, nothing sharded
    # LoRA: frozen weights keep only their 2 bytes; states for the adapters only
    lora_gpu, _ = est.model_states(0, False, False, shape(trainable=P // 100), mixed_adam, 1, 1, False)
    assert lora_gpu == 2 * P + 18 * (P // 100)
    fp32 = make_cfg("precision=fp32", check_files=False)
    assert est.model_states(0, False, False, shape(), fp32, 1, 1, False)[0] == 4 * P + 4 * P + 8 * P
    sgd = make_cfg("precision=bf16", "optimizer=sgd", check_files=False)
    assert est.model_states(2, False, False, shape(), sgd, 1, 1, False)[0] < by[(2, "none")] * 8


def test_tiny_model_shape_counts_like_deepspeed(make_cfg):
    from deepspeed.runtime.zero.stage3 import model_to_params

    from dsrecipes.modeling.model import build_model, load_tokenizer

    cfg = make_cfg(check_files=False)
    s = est.model_shape(cfg)
    model = build_model(cfg, load_tokenizer(cfg))
    assert (s.total_params, s.largest_layer_params) == model_to_params(model)
    assert s.trainable_params == s.total_params and s.layers == cfg.model.tiny.num_hidden_layers


def test_lora_shape_counts_adapters(make_cfg):
    from dsrecipes.modeling.model import build_model, count_parameters, load_tokenizer

    cfg = make_cfg("model.lora.enabled=true", check_files=False)
    s = est.model_shape(cfg)
    trainable, total = count_parameters(build_model(cfg, load_tokenizer(cfg)))
    assert (s.total_params, s.trainable_params) == (total, trainable)


def test_hf_config_dir_and_num_params(make_cfg, tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ).save_pretrained(tmp_path)
    cfg = make_cfg(f"model.path={tmp_path}", check_files=False)
    s = est.model_shape(cfg)
    assert s.total_params == 494_032_768  # Qwen2.5-0.5B
    assert s.largest_layer_params == 151936 * 896 and s.kv_dim == 2 * 64
    from dataclasses import replace

    no_path = make_cfg("model=llama3_8b", check_files=False)
    no_path = replace(no_path, model=replace(no_path.model, arch={}))  # no config.json and no shipped shape
    s = est.model_shape(no_path)
    assert s.total_params == no_path.model.num_params and s.hidden is None


def test_activations_shrink_with_checkpointing(make_cfg):
    cfg = make_cfg("precision=bf16", "data.cutoff_len=1024", "trainer.micro_batch_size=2", check_files=False)
    s = est.ModelShape(P, P, L, hidden=896, intermediate=4864, layers=24, heads=14, kv_dim=128, vocab=151936)
    no_gc, gc = est.activation_bytes(s, cfg, False), est.activation_bytes(s, cfg, True)
    tokens = 2 * 1024
    assert no_gc == 24 * tokens * (7 * 896 + 2 * 128 + 4 * 4864) * 2 + tokens * 151936 * 10
    per_layer = tokens * (7 * 896 + 2 * 128 + 4 * 4864) * 2
    assert gc == 24 * tokens * 896 * 2 + per_layer + tokens * 151936 * 10 and gc < no_gc


def test_cli_table_and_json(capsys):
    assert estimate_main(["zero=stage2", "precision=bf16", "--gpus-per-node", "8", "--gpu-mem-gb", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "| stage2 * | none |" in out and "fits 0.1 GiB" in out
    assert estimate_main(["model=llama3_8b", "precision=bf16", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fits = {(r["stage"], r["offload"]): r["fits_no_gc"] for r in data["rows"]}
    assert fits[(0, "none")] is False and fits[(3, "none")] is True  # 8B: 160 GB of states unsharded, 20 GB at ZeRO-3


@pytest.mark.parametrize("model", ["qwen2_5_0_5b", "llama3_8b", "opt_1_3b"])
def test_shipped_model_shapes_match_their_published_parameter_counts(make_cfg, model):
    """`model.arch` lets `estimate` work before the weights are downloaded; its shape must be the real one."""
    from dsrecipes.run.estimate import model_shape

    published = make_cfg(f"model={model}", check_files=False).model.num_params
    shape = model_shape(make_cfg(f"model={model}", "model.num_params=null", check_files=False))
    assert shape.total_params == published and shape.source == f"model.arch of model={model}"
    assert shape.hidden and shape.layers and shape.vocab
