"""DeepSpeed's shared-memory communication op on CPU: is it built, say so before it is built, build it ahead.

On a CPU accelerator, `deepspeed.init_distributed()` JIT-compiles the `deepspeed_shm_comm` op the first time a
multi-rank job starts on a machine: one to three minutes without a word, then cached in torch's extension directory
(TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py<ver>_<cpu|cuXY>). `status()` reads whether that build is
still ahead (used by `dsrecipes doctor`), `announce()` says so before a rank starts it, and `build()` does it now
(`dsrecipes doctor --build-ops`). Reading the status builds and creates nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

NAME = "deepspeed_shm_comm"


@dataclass(frozen=True)
class ShmOpStatus:
    needed: bool  # CPU accelerator: every multi-rank process group loads the op
    built: bool
    where: str  # the built library (or where the JIT build will put it)

    def describe(self) -> str:
        if not self.needed:
            return f"{NAME}: not used (not a CPU accelerator)"
        if self.built:
            return f"{NAME}: built ({self.where})"
        return f"{NAME}: not built yet; the first multi-rank CPU run builds it (1-3 minutes, once) into {self.where}"


def _builder():
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return None
    builder = accelerator.create_op_builder("ShareMemCommBuilder")
    import deepspeed.ops

    # the same test deepspeed.comm.torch.build_shm_op applies before loading it
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def build_directory(name: str = NAME) -> Path:
    """Where torch.utils.cpp_extension.load builds `name` (its own rule, without creating the directory)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cu = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{cu}")
    return Path(root) / name


def status() -> ShmOpStatus:
    builder = _builder()
    if builder is None:
        return ShmOpStatus(False, False, "")
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(builder.name, False):
        return ShmOpStatus(True, True, "installed with deepspeed (DS_BUILD_SHM_COMM=1)")
    library = build_directory(builder.name) / f"{builder.name}.so"
    return ShmOpStatus(True, library.is_file(), str(library))


def announce() -> None:
    """Before `deepspeed.init_distributed()` of a multi-rank job: name the build that is about to start, once per
    node (local rank 0), so minutes of silence are not taken for a hang."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        current = status()
    except Exception:  # noqa: BLE001 - a message must never stop a run
        return
    if current.needed and not current.built:
        print(f"dsrecipes: building DeepSpeed's shared-memory op {NAME} for CPU process groups (once per machine, "
              f"usually 1-3 minutes) into {current.where}; `dsrecipes doctor --build-ops` builds it ahead of time",
              file=sys.stderr, flush=True)  # fmt: skip


def build() -> ShmOpStatus:
    """Build (or load, when cached) the op now."""
    builder = _builder()
    if builder is not None:
        builder.load(verbose=False)
    return status()
