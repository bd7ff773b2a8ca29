"""Importing DeepSpeed without two start-up costs it does not need: the one place every dsrecipes process imports it.

`import deepspeed` imports its autotuner, which imports mlflow whenever mlflow is installed
(deepspeed/autotuning/autotuner.py, `try: import mlflow`). That is 1.3-1.6 s of CPU on every process that imports
DeepSpeed - the launching process and every rank (measured on the 2-core test machine: `import deepspeed` 3.5-3.8 s
user with mlflow installed, 2.1-2.2 s without). dsrecipes never runs DeepSpeed's autotuner; our mlflow tracker
(trackers.py) imports mlflow itself when a run reports to it. So the first import of DeepSpeed happens here, with
mlflow hidden from it for that one import (DeepSpeed's autotuner then records `has_mlflow = False`), and mlflow is
importable again right after.

DeepSpeed's ZeRO-1/2 code imports its Muon optimizer module on first use (`is_zero_supported_optimizer` when the
engine starts, `average_tensor` at the first gradient reduction), and that module decorates three functions with
`deepspeed.runtime.compiler.compile()`, i.e. `torch.compile(fn)` at import time, which imports TorchInductor's
`compile_fx` and Dynamo's debugging utilities: 2.1-2.3 s of CPU in every ZeRO-1/2 rank (measured: a fresh
interpreter with transformers and DeepSpeed loaded, then `import deepspeed.runtime.zero.muon.original_muon`).
dsrecipes has no Muon optimizer (conf/optimizer), so those kernels never run; DeepSpeed only checks
`isinstance(optimizer, MuonWithAuxAdam)`. `compiler.compile` is replaced here by the same decorator applied on
the first call instead of at import: `torch.compile(fn)` with the same arguments, compiled once when (if ever) a
decorated function is called.
"""

from __future__ import annotations

import functools
import importlib
import sys
from types import ModuleType
from typing import Any, Callable


def load_deepspeed() -> ModuleType:
    """The `deepspeed` package, imported once per process (see the module docstring)."""
    deepspeed = sys.modules.get("deepspeed") or _import_without_mlflow()
    try:
        compiler = importlib.import_module("deepspeed.runtime.compiler")
    except ImportError:  # a DeepSpeed without it has no such decorator to defer
        return deepspeed
    _compile_on_first_call(compiler)
    return deepspeed


def _import_without_mlflow() -> ModuleType:
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError while this is set
    try:
        return importlib.import_module("deepspeed")
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]


def _compile_on_first_call(compiler: ModuleType) -> None:
    """`compiler.compile()` (DeepSpeed's `torch.compile` decorator) deferred to each function's first call."""
    eager = getattr(compiler, "compile", None)
    if eager is None or getattr(eager, "_dsrecipes_deferred", False):
        return

    def compile(*args: Any, **kwargs: Any) -> Callable[[Callable], Callable]:
        def decorate(fn: Callable) -> Callable:
            compiled = None

            @functools.wraps(fn)
            def call(*a: Any, **kw: Any) -> Any:
                nonlocal compiled
                if compiled is None:
                    compiled = eager(*args, **kwargs)(fn)
                return compiled(*a, **kw)

            return call

        return decorate

    compile._dsrecipes_deferred = True
    compiler.compile = compile
