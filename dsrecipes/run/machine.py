"""What `dsrecipes doctor` reads from the machine: versions, PATH, devices, file systems, the JIT-op cache.

Everything goes through a `Probe`, so tests can describe a fake machine by subclassing it. Nothing here builds a
DeepSpeed op or starts a process group.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from ctypes.util import find_library
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Dict, List, Mapping, Optional

from dsrecipes.core.deepspeed_import import load_deepspeed


class Probe:
    """Everything doctor reads from the machine. Tests subclass it to describe a fake machine."""

    def __init__(self, environ: Optional[Mapping[str, str]] = None):
        self.environ = dict(os.environ if environ is None else environ)

    def which(self, name: str) -> Optional[str]:
        return shutil.which(name, path=self.environ.get("PATH"))

    def run(self, argv: List[str]) -> Optional[str]:
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10, env=self.environ)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout + done.stderr

    def version(self, dist: str) -> Optional[str]:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    def torch(self) -> Dict[str, object]:
        import torch

        info: Dict[str, object] = {"version": torch.__version__, "cuda": torch.version.cuda, "devices": []}
        info["cuda_available"] = torch.cuda.is_available()
        if info["cuda_available"]:
            info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            info["bf16"] = torch.cuda.is_bf16_supported()
        return info

    def accelerator(self) -> str:
        load_deepspeed()  # first import without the autotuner's mlflow (1.5 CPU s): as every dsrecipes process
        from deepspeed.accelerator import get_accelerator  # picks the accelerator; builds nothing

        return get_accelerator().device_name()

    def shm_bytes(self) -> Optional[int]:
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return None
        return st.f_frsize * st.f_blocks

    def find_library(self, name: str) -> Optional[str]:
        return find_library(name)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def writable(self, path: str) -> bool:
        p = Path(path)
        while not p.exists() and p != p.parent:
            p = p.parent
        return os.access(p, os.W_OK)

    def lock_files(self, root: str) -> List[tuple]:
        """(path, age in seconds) of `lock` files left in a torch extensions cache."""
        now = time.time()
        return [(str(p), now - p.stat().st_mtime) for p in Path(root).glob("*/lock")] if os.path.isdir(root) else []

    def built_ops(self, root: str) -> List[str]:
        """The ops built in a build root (jit_ops.build_root: <root>/<op>/<op>.so)."""
        return sorted(p.parent.name for p in Path(root).glob("*/*.so")) if os.path.isdir(root) else []
