"""Fifth user walkthrough: estimate's CPU figure under LoRA, re-running a finished sweep, qwen's tool turns."""

from __future__ import annotations

import json

from dsrecipes.commands.estimate import main as estimate_main

GIB = 1024**3


def _rows(capsys, *argv):
    assert estimate_main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    return data, {(r["stage"], r["offload"]): r for r in data["rows"]}


def test_estimate_lora_zero3_optimizer_offload_cpu_is_never_below_loading_the_model(capsys):
    """LoRA r=16 on Llama-3-8B, 8 GPUs, ZeRO-3 + optimizer=cpu. Was: 0.30 GiB CPU per node (16 bytes x 13.6M adapter
    parameters x 1.5), below the 23.48 GiB the same table gave ZeRO-3 without offload (zero.Init: the largest layer
    in fp32 on each of 8 ranks): offloading the optimizer seemed to need less CPU than not offloading it."""
    data, rows = _rows(capsys, "recipe=sharegpt_lora_llama3_8b_zero3", "offload=cpu_optimizer")
    s = data["shape"]
    T, L, P = s["trainable_params"], s["largest_layer_params"], s["total_params"]
    assert T == 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024))  # r=16 on q/k/v/o of 32 layers: 13,631,488
    assert L == 128256 * 4096 and P == 8_030_261_248 + T
    load, states = L * 4 * 8 * 1.5, 16 * T * 1.5  # DeepSpeed's zero.Init figure; fp32 master+grad+Adam of T
    opt = rows[(3, "optimizer=cpu")]
    assert (opt["cpu_load"], opt["cpu_offloaded"], opt["cpu_per_node"]) == (load, states, load)
    assert round(opt["cpu_per_node"] / GIB, 2) == 23.48 and round(states / GIB, 2) == 0.30
    both = rows[(3, "optimizer=cpu,param=cpu")]  # + the frozen base's 2-byte weights on the CPU
    assert both["cpu_offloaded"] == (2 * P + 16 * T) * 1.5 and both["cpu_per_node"] == max(load, both["cpu_offloaded"])
    for stage in (1, 2, 3):  # offloading never needs less CPU than the same stage without it
        none = rows[(stage, "none")]["cpu_per_node"]
        assert all(r["cpu_per_node"] >= none for (st, _), r in rows.items() if st == stage)


def test_estimate_table_says_what_the_cpu_figure_counts_under_lora(capsys):
    assert estimate_main(["recipe=sharegpt_lora_llama3_8b_zero3", "offload=cpu_optimizer"]) == 0
    out = capsys.readouterr().out
    assert "| stage3 * | optimizer=cpu | 3.83 | 56.62 | 16.96 | 23.48 (23.48 / 0.30) |" in out
    assert "CPU per node: the larger of loading the model" in out and "16 bytes per trainable parameter" in out
    assert "LoRA: the offloaded optimizer states are the 13.63M trainable adapter parameters' only" in out
    assert "8030.3M frozen base parameters" in out
