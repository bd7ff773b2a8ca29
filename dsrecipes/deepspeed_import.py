"""Importing DeepSpeed without the autotuner's mlflow import: the one place every dsrecipes process imports it.

`import deepspeed` imports its autotuner, which imports mlflow whenever mlflow is installed
(deepspeed/autotuning/autotuner.py, `try: import mlflow`). That is 1.3-1.6 s of CPU on every process that imports
DeepSpeed - the launching process and every rank (measured on the 2-core test machine: `import deepspeed` 3.5-3.8 s
user with mlflow installed, 2.1-2.2 s without). dsrecipes never runs DeepSpeed's autotuner; our mlflow tracker
(trackers.py) imports mlflow itself when a run reports to it. So the first import of DeepSpeed happens here, with
mlflow hidden from it for that one import (DeepSpeed's autotuner then records `has_mlflow = False`), and mlflow is
importable again right after.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def load_deepspeed() -> ModuleType:
    """The `deepspeed` package, imported once per process (see the module docstring)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError while this is set
    try:
        return importlib.import_module("deepspeed")
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
