"""One world size for every tool: show, audit, estimate, the run plan and the launchers use resolve_topology()."""

from __future__ import annotations

import pytest

from dsrecipes.core.schema import LauncherConfig, LauncherKind
from dsrecipes.core.topology import Topology, resolve_topology


def test_deepspeed_defaults_to_every_visible_device():
    ln = LauncherConfig(kind=LauncherKind.deepspeed)
    assert ln.num_gpus is None
    assert resolve_topology(ln, device_count=8, environ={}) == Topology(8, 1, 8)
    assert resolve_topology(ln, device_count=8, environ={"CUDA_VISIBLE_DEVICES": "1,3"}) == Topology(2, 1, 2)
    assert resolve_topology(LauncherConfig(kind=LauncherKind.deepspeed, num_gpus=2), device_count=8,
                            environ={}) == Topology(2, 1, 2)


def test_hostfile_slots_and_selection(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=4\nworker-1 slots=2\n")
    ln = LauncherConfig(kind=LauncherKind.deepspeed, hostfile=str(hostfile), num_nodes=2)
    assert resolve_topology(ln, environ={}) == Topology(6, 2, 4)
    picked = LauncherConfig(kind=LauncherKind.deepspeed, hostfile=str(hostfile), include="worker-1:0")
    assert resolve_topology(picked, environ={}) == Topology(1, 1, 1)


@pytest.mark.parametrize("kind", [LauncherKind.torchrun, LauncherKind.mpirun, LauncherKind.deepspeed_multinode])
def test_ranks_per_node_times_nodes(kind):
    assert resolve_topology(LauncherConfig(kind=kind, num_gpus=None, num_nodes=3), device_count=4) == Topology(12, 3, 4)
    assert resolve_topology(LauncherConfig(kind=kind, num_gpus=2, num_nodes=2), device_count=4) == Topology(4, 2, 2)


def test_local_is_one_process():
    assert resolve_topology(LauncherConfig(kind=LauncherKind.local), device_count=8) == Topology(1, 1, 1)


def test_preview_tools_describe_the_run_that_starts(make_cfg, capsys, tmp_path):
    """`show` and `audit` default to the launcher's own world size, not (num_gpus or 1) x num_nodes."""
    from dsrecipes.commands.show import main as show

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=3\nb slots=3\n")
    assert show(["launcher=deepspeed", f"launcher.hostfile={hostfile}", "launcher.num_nodes=2", "--json-only"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["train_batch_size"] == 8 * 6
