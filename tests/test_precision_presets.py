"""Large-model presets train in bf16 unless told otherwise, and say when a device makes them fall back (issue 22
item 7). DeepSpeed's CPU accelerator supports bf16, so CPU runs keep it; a GPU without bf16 (pre-Ampere) gets fp16
with a note."""

from __future__ import annotations

import dataclasses

import pytest

from dsrecipes.core.paths import PACKAGE_DIR
from dsrecipes.core.schema import Precision
from dsrecipes.run.resolve import _this_device, precision_for_device

LARGE = 4e8  # parameters from which a preset defaults to bf16

PRESETS = sorted(p.stem for p in (PACKAGE_DIR / "conf" / "model").glob("*.yaml"))


def test_there_are_presets_of_both_kinds():
    assert "llama3_8b" in PRESETS and "tiny" in PRESETS


@pytest.mark.parametrize("preset", PRESETS)
def test_large_presets_default_to_bf16_and_the_command_line_wins(make_cfg, preset):
    cfg = make_cfg(f"model={preset}", check_files=False)
    large = (cfg.model.num_params or 0) >= LARGE
    assert cfg.precision.dtype is (Precision.bf16 if large else Precision.fp32), preset
    assert make_cfg(f"model={preset}", "precision=fp32", check_files=False).precision.dtype is Precision.fp32
    assert make_cfg(f"model={preset}", "precision=fp16", check_files=False).precision.dtype is Precision.fp16


def test_a_recipe_keeps_the_presets_bf16(make_cfg):
    cfg = make_cfg("recipe=sharegpt_lora_llama3_8b_zero3", check_files=False)
    assert cfg.model.name == "llama3_8b" and cfg.precision.dtype is Precision.bf16


def test_a_gpu_without_bf16_falls_back_to_fp16_and_says_so(make_cfg):
    cfg = make_cfg("model=llama3_8b", check_files=False)
    chosen, note = precision_for_device(cfg, "Tesla V100-SXM2-32GB", native_bf16=False)
    assert chosen.precision.dtype is Precision.fp16
    assert note.startswith("precision: Tesla V100-SXM2-32GB has no bf16; training in fp16 instead")
    assert precision_for_device(cfg, "NVIDIA H100", native_bf16=True) == (cfg, None)
    assert precision_for_device(cfg, None, native_bf16=True) == (cfg, None)  # CPU: DeepSpeed's CPU bf16
    fp32 = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, dtype=Precision.fp32))
    assert precision_for_device(fp32, "Tesla V100-SXM2-32GB", native_bf16=False) == (fp32, None)


def test_a_cpu_without_native_bf16_keeps_it_and_says_fp32_is_faster_there(make_cfg):
    cfg = make_cfg("model=llama3_8b", check_files=False)
    chosen, note = precision_for_device(cfg, None, native_bf16=False)
    assert chosen is cfg and chosen.precision.dtype is Precision.bf16
    assert note == ("precision: bf16 on a CPU without fast bf16 (oneDNN reports none: no AVX-512 or Arm BF16, or a "
                    "torch without oneDNN): its matmuls are emulated, often several times slower than fp32; "
                    "precision=fp32 trains faster here")
    fp32 = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, dtype=Precision.fp32))
    assert precision_for_device(fp32, None, native_bf16=False) == (fp32, None)


def test_the_cpu_check_is_what_onednn_says():
    import torch

    from dsrecipes.run.resolve import cpu_has_native_bf16

    flags = set(open("/proc/cpuinfo").read().split()) if torch.backends.mkldnn.is_available() else set()
    if {"avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert cpu_has_native_bf16()
    elif "avx2" in flags and "avx512bw" not in flags:  # an AVX2-only x86 CPU: emulated
        assert not cpu_has_native_bf16()


def test_this_cpu_machine_keeps_bf16(make_cfg):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the GPU decides")
    from deepspeed.accelerator import get_accelerator

    assert get_accelerator().is_bf16_supported()  # what makes bf16 right on CPU
    cfg = make_cfg("model=llama3_8b", check_files=False)
    assert precision_for_device(cfg, *_this_device(cfg))[0] == cfg  # kept, with or without the note
