"""Process-group plumbing: joining and leaving the group, small collectives, and ports.

Nothing here knows about training or configs; `train.py` (the ranks) and the launchers (ports) use it, and it
imports neither of them.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Tuple

import dsrecipes.core.jit_ops as jit_ops
from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.final_barrier import final_barrier

if TYPE_CHECKING:
    import torch

NOTE_S = 10.0  # a wait the first rank of a node names after this long (`noting`)
SINGLE_PROCESS_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


def free_port() -> int:
    """A TCP port that is free on this machine right now (for a master/rendezvous port nobody configured)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHM_DIR = "/dev/shm"
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"  # DeepSpeed's CPU shared-memory all-reduce (csrc/cpu/comm/shm.cpp)


def remove_shm_buffers(port: int) -> List[str]:
    """Delete the shared-memory all-reduce buffers the ranks of the run on `port` left in /dev/shm.

    DeepSpeed's CPU shm op creates one ~70 MB segment per rank, named after the user, master address and port, and
    never unlinks it: every multi-rank CPU run would leave them in RAM (tmpfs) until the machine runs out of memory.
    Called by the launching process after its ranks ended; the names carry this run's port, so no other run's
    segment matches while that run is alive."""

    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{SHM_BUFFER_PREFIX}_{os.getuid()}_*_{int(port)}_*")):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def init_distributed(before_join: Optional[Callable[[], None]] = None) -> Tuple[int, int]:
    """Join the process group the launcher described in the environment (a lone process becomes rank 0 of 1);
    `before_join` runs right before (the bounded rendezvous: core/rendezvous.py).

    Returns (rank, world size).
    """
    import torch
    import torch.distributed as dist

    deepspeed = load_deepspeed()
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ and "PMI_RANK" not in os.environ:
        os.environ.update(SINGLE_PROCESS_ENV)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU host split its cores, leaving one for the launcher, data and OS: oversubscribed
        # intra-op threads spin-wait (the default tiny run took 117 s with 2 threads on a busy 2-core host, 29 s with 1).
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        torch.set_num_threads(max(1, ((os.cpu_count() or 1) - 1) // local_size))

    jit_ops.prepare_rank()  # this environment's own op builds, each announced before it starts
    skip_shm_comm_op()
    if before_join is not None:
        before_join()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    with noting(f"starting the process group ({where}) with every rank (one that died or stopped meanwhile is named "
                "after launcher.peer_timeout_s)"):  # fmt: skip
        deepspeed.init_distributed()
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def noting(what: str, first_s: float = NOTE_S) -> Iterator[None]:
    """While the block lasts (a wait bounded elsewhere), a line from the first rank of each node after `first_s`,
    then every 3 times that: 'dsrecipes: rank R: WHAT: N s so far'."""
    done, began = threading.Event(), time.monotonic()

    def note() -> None:
        wait = first_s
        while not done.wait(wait):
            print(f"dsrecipes: rank {os.environ.get('RANK', '0')}: {what}: {time.monotonic() - began:.0f} s so far",
                  file=sys.stderr, flush=True)  # fmt: skip
            wait = 3 * first_s

    if os.environ.get("LOCAL_RANK", "0") == "0":
        threading.Thread(target=note, name="dsrecipes-note", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def skip_shm_comm_op() -> None:
    """Training needs no DeepSpeed shared-memory all-reduce op: on a CPU accelerator DeepSpeed loads it with every
    process group, but only `inference_all_reduce` (AutoTP inference) calls it; training's collectives go to
    torch.distributed (gloo). Skipping it saves its JIT build (minutes, the first time in an environment) and its
    /dev/shm segment per rank. DeepSpeed treats a missing op as "use torch.distributed", the path it takes where the
    op cannot be built (the same loss step for step: tests/test_jit_ops.py)."""

    try:  # (`import deepspeed.comm.torch as m` would bind the torch package that deepspeed.comm re-exports)
        ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    except ImportError:  # another DeepSpeed layout: keep its default
        return
    if hasattr(ds_comm_torch, "build_shm_op"):
        ds_comm_torch.build_shm_op = lambda: None


def finish_distributed() -> None:
    """Wait for every rank, bounded (core/final_barrier.py: a rank that froze or died on its way is named). The
    process group is left up on purpose: DeepSpeed caches its groups per process and cannot rebuild them after
    destroy_process_group, so the next in-process run (local launcher, Hydra multirun) reuses this one. Launched
    ranks exit right after."""
    import torch.distributed as dist

    if dist.is_initialized():
        final_barrier(dist.barrier)


def all_ranks(flag: bool) -> bool:
    """True when `flag` holds on every rank (collective)."""
    import torch

    return bool(all_reduce(torch.tensor([1 if flag else 0], dtype=torch.int64), "MIN").item())


def all_reduce(tensor: torch.Tensor, op: str = "SUM") -> torch.Tensor:
    """Collective: reduce `tensor` over every rank in place (`op`: a `ReduceOp` name) and return it; without a
    process group, `tensor` as it is. The small host-side tallies (flags, counts, metric sums) are built on the CPU,
    which gloo reduces but NCCL does not ("No backend type associated with device type cpu"): they travel to the
    device the group's backend reduces on and back. Every host-side collective of dsrecipes goes through here
    (tests/test_distributed_collectives.py)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    device = collective_device()
    moved = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(moved, op=getattr(dist.ReduceOp, op))
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def collective_device(backend: str | None = None) -> torch.device:
    """The device the default process group reduces host tensors on: the CPU where its backend takes CPU tensors
    (gloo, MPI), otherwise this rank's accelerator (NCCL and the other device-only backends)."""
    import torch
    import torch.distributed as dist

    backend = backend if backend is not None else str(dist.get_backend())
    if backend in ("gloo", "mpi") or "cpu:" in backend:  # ("cpu:gloo,cuda:nccl": a group with a CPU backend too)
        return torch.device("cpu")
    return torch.device(load_deepspeed().accelerator.get_accelerator().current_device_name())
