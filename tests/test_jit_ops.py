"""Each Python environment keeps its own build of DeepSpeed's JIT ops, announced the first time, in the directory
`dsrecipes doctor` checks; a 2-rank start starts no DeepSpeed runner and
DeepSpeed's import pulls in no mlflow for its autotuner (issue 22 item 1: multi-rank start in seconds).

The slow tests are real: a second environment is a real `python -m venv --system-site-packages`, the op is a real
C++ extension built by DeepSpeed's own OpBuilder.jit_load (a small one, so it builds in seconds), the doctor is the
`dsrecipes doctor --json` command (cli.main, run by each environment's interpreter right after its silent reload of
the op, under the environment that process started with: one interpreter start less per environment), and the
2-rank run is `python -m dsrecipes launcher=deepspeed`. That training builds no shared-memory op is checked on
tests/test_train_runs.py's 2-rank run (started from an empty extensions cache).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

import dsrecipes.core.jit_ops as jit_ops
from tests.conftest import require_cxx, subprocess_env


def test_two_environments_never_share_a_build_directory():
    env = {"HOME": "/home/u"}
    a = jit_ops.build_root(env, jit_ops.environment_key("/venvs/a", "2.13.0+cpu", "0.19.8"))
    b = jit_ops.build_root(env, jit_ops.environment_key("/venvs/b", "2.13.0+cpu", "0.19.8"))
    newer_ds = jit_ops.build_root(env, jit_ops.environment_key("/venvs/a", "2.13.0+cpu", "0.20.0"))
    newer_torch = jit_ops.build_root(env, jit_ops.environment_key("/venvs/a", "2.14.0+cpu", "0.19.8"))
    assert len({a, b, newer_ds, newer_torch}) == 4
    assert a.parent == Path("/home/u/.cache/torch_extensions/dsrecipes")
    assert jit_ops.environment_key("/venvs/a") == jit_ops.environment_key("/venvs/a")  # stable
    assert jit_ops.build_root({"HOME": "/h", "XDG_CACHE_HOME": "/c"}).parent == Path("/c/torch_extensions/dsrecipes")


def test_the_users_torch_extensions_dir_wins(monkeypatch, tmp_path):
    assert jit_ops.build_root({"HOME": "/home/u", "TORCH_EXTENSIONS_DIR": "/scratch/ext"}) == Path("/scratch/ext")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert jit_ops.prepare_rank() == tmp_path and os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jit_ops.prepare_rank() == jit_ops.build_root() and os.environ["TORCH_EXTENSIONS_DIR"] == str(
        tmp_path / "torch_extensions" / "dsrecipes" / jit_ops.environment_key())


TINY_OP = r'''
import os
import sys
from pathlib import Path

from dsrecipes.core.deepspeed_import import load_deepspeed

load_deepspeed()  # as every dsrecipes process imports DeepSpeed (without its autotuner's mlflow import)
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder  # noqa: E402

import dsrecipes.core.jit_ops as jit_ops  # noqa: E402

SOURCE = Path(sys.argv[1])


class TinyBuilder(CPUOpBuilder):
    NAME = "dsrecipes_tiny_op"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return self.NAME

    def sources(self):
        return [str(SOURCE)]

    def include_paths(self):
        return []

    def cxx_args(self):
        return ["-O0", "-g"]


started_with = dict(os.environ)
root = jit_ops.prepare_rank()  # what every rank does in distributed.init_distributed
print("answer", TinyBuilder().load(verbose=False).answer(), "root", root, flush=True)
if sys.argv[2:] == ["--then-doctor"]:  # `dsrecipes doctor --json` next, in this interpreter: what `python -m
    os.environ.clear()  # dsrecipes doctor --json` runs (cli.main), under the environment this process started
    os.environ.update(started_with)  # with (prepare_rank set TORCH_EXTENSIONS_DIR for the rank only)
    from dsrecipes.cli import main  # noqa: E402

    sys.exit(main(["doctor", "--json"]))
'''

# The CPython C API alone (no pybind11/torch headers): a real extension module that compiles in a fraction of a
# second, where a pybind11 one takes ~10 CPU s per environment on the 2-core test machine.
TINY_SOURCE = r'''
#include <Python.h>
static PyObject* answer(PyObject* self, PyObject* args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dsrecipes_tiny_op", NULL, -1, methods};
PyMODINIT_FUNC PyInit_dsrecipes_tiny_op(void) { return PyModule_Create(&module); }
'''


@pytest.mark.slow
def test_environments_build_apart_once_each_announced_where_doctor_looks(tmp_path):
    require_cxx()
    (tmp_path / "tiny_op.py").write_text(TINY_OP)
    (tmp_path / "tiny_op.cpp").write_text(TINY_SOURCE)
    venv = tmp_path / "venv_b"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    env = subprocess_env({"XDG_CACHE_HOME": str(tmp_path / "cache"), "LOCAL_RANK": "0"})
    env.pop("TORCH_EXTENSIONS_DIR", None)
    pythons = {"A": sys.executable, "B": str(venv / "bin" / "python")}

    def load(who: str, chosen: Optional[Path] = None, then_doctor: bool = False) -> tuple[Path, str]:
        argv = [pythons[who], str(tmp_path / "tiny_op.py"), str(tmp_path / "tiny_op.cpp")]
        done = subprocess.run(argv + ["--then-doctor"] * then_doctor, capture_output=True, text=True, timeout=600,
                              env={**env, "TORCH_EXTENSIONS_DIR": str(chosen)} if chosen else env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "answer 42" in done.stdout
        root, _, findings = done.stdout.split(" root ")[1].partition("\n")
        doctors[who] = findings and [f["message"] for f in json.loads(findings) if f["check"] == "torch_extensions"]
        return Path(root.strip()), done.stderr

    doctors: dict = {}  # who -> the doctor's torch_extensions finding, from a load with then_doctor

    root_a, said = load("A")
    assert "building DeepSpeed's dsrecipes_tiny_op (a C++ op) for this Python environment, once" in said
    assert f"later runs reuse it from {root_a / 'dsrecipes_tiny_op'}" in said and "dsrecipes_tiny_op built in" in said
    library_a = root_a / "dsrecipes_tiny_op" / "dsrecipes_tiny_op.so"
    built_at = library_a.stat().st_mtime_ns
    root_b, said = load("B")  # the other environment builds its own ...
    assert root_b != root_a and "building DeepSpeed's dsrecipes_tiny_op" in said
    for who, root in (("A", root_a), ("B", root_b)):  # ... and they alternate without rebuilding each other's
        assert load(who, then_doctor=True) == (root, "")  # silent: nothing to build (nor from the doctor)
        assert doctors[who] == [f"{root}: built ops: dsrecipes_tiny_op"]  # the doctor looks where the run builds
    assert library_a.stat().st_mtime_ns == built_at
    # ours build without DeepSpeed's -g (jit_ops.NO_DEBUG_INFO); a directory the user chose keeps the op's flags
    assert load("A", tmp_path / "chosen")[0] == tmp_path / "chosen"
    for root, debug_info in ((root_a, False), (root_b, False), (tmp_path / "chosen", True)):
        ninja = (root / "dsrecipes_tiny_op" / "build.ninja").read_text()
        flags = re.search(r"^cflags = (.*)$", ninja, re.M).group(1).split()
        assert "-O0" in flags and ("-g" in flags) is debug_info, (root, flags)


IMPORT_IN_A_RANK = """
import sys
import torch
from dsrecipes.core.deepspeed_import import load_deepspeed
load_deepspeed()
import deepspeed.autotuning.autotuner as autotuner
print("mlflow" in sys.modules, autotuner.has_mlflow)
compiled = []
torch.compile = lambda fn, **kw: compiled.append(fn.__name__) or fn  # what DeepSpeed's compiler.compile() returns
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # ZeRO-1/2
from deepspeed.runtime.zero.muon.original_muon import zeropower_via_newtonschulz5  # what it imports on first use
print("torch._inductor.compile_fx" in sys.modules, compiled)
G = torch.randn(4, 4)
for _ in range(2):
    zeropower_via_newtonschulz5(G, steps=1)
print(compiled)
import mlflow
print(mlflow.MlflowClient.__name__)
"""


def test_deepspeed_imports_without_the_autotuners_mlflow_and_compiles_muon_only_when_called():
    """DeepSpeed's autotuner imports mlflow (1.5 CPU s) in every process that imports DeepSpeed; ours import it
    without (dsrecipes/core/deepspeed_import.py), and mlflow still imports afterwards (a run that tracks to mlflow).
    ZeRO-1/2 import DeepSpeed's Muon kernels, whose `torch.compile` decorators import TorchInductor (2.1-2.3 CPU s
    per rank): ours compile each of them on its first call, once, and a run without Muon never imports Inductor."""
    done = subprocess.run([sys.executable, "-c", IMPORT_IN_A_RANK], capture_output=True, text=True, timeout=300,
                          env=subprocess_env({"DS_ACCELERATOR": "cpu"}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["False False", "False []", "['zeropower_via_newtonschulz5']", "MlflowClient"]
