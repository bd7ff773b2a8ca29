"""The optimizer DeepSpeed really builds, for every optimizer x offload x ZeRO stage the rules accept (CPU engines).

With `"torch_adam": true` DeepSpeed built torch's AdamW even for an offloaded optimizer, although DeepSpeed's CPU
Adam is the reason to offload. One subprocess builds every engine (the CPU ops JIT-build once, 1-3 minutes each the
first time; CPU Adam comes from the session's one build, conftest.built_cpu_adam). Where DeepSpeed cannot build its
async_io op (no libaio), NVMe offload is refused before any engine, so no pin_memory op is built for it either.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.core import jit_ops
from dsrecipes.core.distributed import free_port
from tests.conftest import subprocess_env

HELPER = Path(__file__).parent / "helpers" / "check_optimizers.py"
CPU_ADAM = "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"
CPU_LION = "deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion"


def expected(optimizer: str, offloaded: bool) -> str:
    if optimizer == "sgd":
        return "torch.optim.sgd.SGD"  # no DeepSpeed SGD: torch's, on the CPU partitions when offloaded
    if offloaded:
        return CPU_LION if optimizer == "lion" else CPU_ADAM
    return {"adamw": "torch.optim.adamw.AdamW", "adam": "torch.optim.adam.Adam"}[optimizer]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # may pay the session's cold CPU Adam build (conftest.built_cpu_adam)
def test_every_optimizer_offload_and_stage_builds_the_right_optimizer(built_cpu_adam):
    _, _, jit_root = built_cpu_adam  # CPU Adam built once for the session; CPU Lion builds beside it
    adam = jit_root / "cpu_adam" / "cpu_adam.so"
    adam_built = adam.stat().st_mtime_ns
    out = subprocess.run([sys.executable, str(HELPER), str(free_port())], capture_output=True, text=True, timeout=900,
                         env=subprocess_env({"TORCH_EXTENSIONS_DIR": str(jit_root)}), cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    assert adam.stat().st_mtime_ns == adam_built  # the session's build, loaded with the rank's flags: not rebuilt
    assert "-g " not in (jit_root / "cpu_lion" / "build.ninja").read_text()  # ours: no debug information (jit_ops)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    built = {tuple(r["overrides"][:3]): r for r in rows if "rejected" not in r}
    assert len(rows) == 4 * 4 * 4  # optimizers x offloads x stages, each reported
    nvme = jit_ops.async_io_buildable()  # DeepSpeed's own test (tests/test_config.py checks it agrees)
    for (opt, off, zero), r in sorted(built.items()):
        name, offload = opt.split("=")[1], off.split("=")[1]
        if offload == "nvme" and not nvme:
            # no libaio here: refused before launch (config.validate.check_runtime), as DeepSpeed's own test says,
            # instead of a rank building the pin_memory op for minutes and then failing on async_io
            assert any(p.startswith("offload.optimizer: nvme offload needs DeepSpeed's async_io op")
                       for p in r["runtime"]), r
            continue
        if name == "lion" and offload == "none":
            assert "FusedLion" in r["runtime"][0], r  # a CUDA kernel: refused before launch on a CPU host
            continue
        assert "error" not in r, r
        assert r["basic"] == expected(name, offload != "none"), (opt, off, zero, r)
        if r["basic"] == CPU_ADAM:
            assert r["adam_w_mode"] is (name == "adamw") and r["torch_adam"] is False
    stages = {k[2] for k, r in built.items() if r.get("basic") == CPU_ADAM}
    assert stages == {"zero=stage1", "zero=stage2", "zero=stage3"}  # offloaded Adam at every stage that allows it
