"""Host-side collectives work under every backend: NCCL takes no CPU tensors.

The flags, counts and metric sums the ranks agree on are built on the CPU. Under gloo (every CPU run) that is fine;
under NCCL (`trainer.device=cuda`) `dist.all_reduce` of a CPU tensor raises "No backend type associated with device
type cpu" -- the GPU smoke test (launch/gpu_smoke.sh, pipeline mode) died there at the first `all_ranks`. So every
host-side collective goes through `dsrecipes.core.distributed.all_reduce`, which reduces on `collective_device()`:
- the mapping from backend to device is checked here;
- `all_reduce` hands the backend a tensor on that device and leaves the result in the caller's tensor;
- no other module of dsrecipes calls `dist.all_reduce` itself (step_guard's flags, already on the engine's device,
  go through it too and stay where they are).
The end-to-end proof is the GPU smoke test's pipeline phase on a real GPU (NCCL).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import dsrecipes.core.distributed as distributed

PACKAGE = Path(distributed.__file__).resolve().parent
# modules allowed to call dist.all_reduce directly, and why
OWN_COLLECTIVES = {
    "distributed.py": "the one host-side helper",
}


def _fake_deepspeed(device_name: str) -> SimpleNamespace:
    accelerator = SimpleNamespace(current_device_name=lambda: device_name)
    return SimpleNamespace(accelerator=SimpleNamespace(get_accelerator=lambda: accelerator))


@pytest.mark.parametrize(
    "backend, expected",
    [("gloo", "cpu"), ("mpi", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("nccl", "cuda:3"), ("xccl", "cuda:3")],
)
def test_collective_device_follows_the_backend(monkeypatch, backend, expected):
    monkeypatch.setattr(distributed, "load_deepspeed", lambda: _fake_deepspeed("cuda:3"))
    assert distributed.collective_device(backend) == torch.device(expected)


def test_all_reduce_reduces_on_the_collective_device_in_place(monkeypatch):
    seen = []

    def fake_all_reduce(tensor, op):
        seen.append((tensor.device, op))
        tensor.mul_(2)  # what a 2-rank SUM of equal values gives

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    sums = torch.tensor([1.5, 2.0], dtype=torch.float64)
    assert distributed.all_reduce(sums) is sums
    assert sums.tolist() == [3.0, 4.0]
    assert seen == [(torch.device("cpu"), dist.ReduceOp.SUM)]
    seen.clear()
    assert distributed.all_ranks(True) is True
    assert seen == [(torch.device("cpu"), dist.ReduceOp.MIN)]


def test_all_reduce_without_a_group_returns_the_tensor_untouched(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # (an in-process run of this worker may leave one up)
    value = torch.tensor([7], dtype=torch.int64)
    assert distributed.all_reduce(value, "MAX") is value and value.tolist() == [7]


def test_no_module_calls_all_reduce_on_host_tensors_itself():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in OWN_COLLECTIVES and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("all_reduce", "reduce", "all_gather", "broadcast"):
                if isinstance(node.value, ast.Name) and node.value.id == "dist":
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: dist.{node.attr}")
    assert not offenders, "use dsrecipes.core.distributed.all_reduce (NCCL takes no CPU tensors):\n" + "\n".join(offenders)
