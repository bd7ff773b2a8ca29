"""How many ranks a launcher config starts, on how many nodes: the one answer every tool uses.

`show`, `audit`, `estimate`, `doctor`, the run plan and the launchers all call `resolve_topology()`, so a preview
describes the run that starts. For `launcher=deepspeed` the answer is DeepSpeed's own runner logic (hostfile or this
machine, `--include/--exclude`, `--num_nodes/--num_gpus`, `CUDA_VISIBLE_DEVICES`); for the others it is ranks per
node x nodes. `launcher.num_gpus: null` means every device of this machine (1 on a CPU-only machine). The device
count and the environment are parameters, so tests can describe any machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.schema import LauncherConfig, LauncherKind, TrainConfig


@dataclass(frozen=True)
class Topology:
    world_size: int  # data-parallel ranks in all
    num_nodes: int
    per_node: int  # ranks per node (the largest node's, for a hostfile with uneven slots)


def local_devices() -> int:
    """CUDA devices on this machine; 1 on a CPU-only machine."""
    import torch

    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


def per_node(ln: LauncherConfig, device_count: Optional[int] = None) -> int:
    """Ranks per node: launcher.num_gpus, or every device of this machine when it is null."""
    if ln.num_gpus is not None:
        return ln.num_gpus
    return local_devices() if device_count is None else device_count


def resolve_topology(ln: LauncherConfig, *, device_count: Optional[int] = None,
                     environ: Optional[Mapping[str, str]] = None) -> Topology:
    """The ranks `ln` starts. `device_count` (default: this machine's) and `environ` (default: os.environ) are
    what the launcher would see."""
    env = os.environ if environ is None else environ
    if ln.kind is LauncherKind.local:
        return Topology(1, 1, 1)
    if ln.kind is LauncherKind.deepspeed:
        slots = deepspeed_local_slots(ln, device_count=device_count, environ=env)
        return Topology(len(slots), 1, len(slots)) if slots is not None else _deepspeed(ln, device_count, env)
    n = per_node(ln, device_count)
    return Topology(n * ln.num_nodes, ln.num_nodes, n)


def deepspeed_local_slots(ln: LauncherConfig, *, device_count: Optional[int] = None,
                          environ: Optional[Mapping[str, str]] = None) -> Optional[list[int]]:
    """For `launcher=deepspeed` on this machine alone: the slots DeepSpeed's runner would hand its per-node launcher
    (`deepspeed.launcher.launch --world_info={"localhost": slots}`), without importing DeepSpeed when
    `launcher.num_gpus` is given. None when the runner has more to resolve (a hostfile, --include/--exclude, or
    CUDA_VISIBLE_DEVICES, which it turns into --include). Like the rest of this module (and so the run plan), it
    takes no `launcher.hostfile` to mean this machine, never DeepSpeed's default `/job/hostfile`."""
    env = os.environ if environ is None else environ
    if ln.kind is not LauncherKind.deepspeed or ln.hostfile or ln.include or ln.exclude:
        return None
    if ln.num_gpus is not None:  # the runner: list(range(num_gpus)) on localhost, whatever the device count
        return list(range(ln.num_gpus))
    if env.get("CUDA_VISIBLE_DEVICES"):
        return None
    return list(range(_accelerator_devices() if device_count is None else device_count))


def _deepspeed(ln: LauncherConfig, device_count: Optional[int], env: Mapping[str, str]) -> Topology:
    # Same resolution as deepspeed/launcher/runner.py: hostfile (or this machine), include/exclude, num_nodes/gpus.
    load_deepspeed()
    from deepspeed.launcher import runner

    selecting = bool(ln.include or ln.exclude)
    if ln.hostfile:
        pool = runner.fetch_hostfile(ln.hostfile)
    else:
        if ln.num_gpus is not None and not selecting:
            return Topology(ln.num_gpus, 1, ln.num_gpus)
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible and not selecting:  # the runner turns it into --include localhost:<ids>
            n = len([d for d in visible.split(",") if d.strip()])
            return Topology(n, 1, n)
        pool = {"localhost": _accelerator_devices() if device_count is None else device_count}
    active = runner.parse_inclusion_exclusion(pool, ln.include or "", ln.exclude or "")
    if not selecting:
        active = runner.apply_num_nodes_and_gpus(active, ln.num_nodes if ln.hostfile else -1, ln.num_gpus or -1)
    slots = [len(s) for s in active.values()]
    return Topology(sum(slots), len(slots), max(slots, default=0))


def _accelerator_devices() -> int:
    load_deepspeed()
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_count()


def train_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Samples (or packed rows) per optimizer step over the whole data-parallel world."""
    return cfg.trainer.micro_batch_size * cfg.trainer.grad_accum * world_size
