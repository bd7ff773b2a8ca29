"""Multi-node torchrun (2 network-namespace nodes x 1 rank, tests/helpers/netns.py): a SIGKILLed agent on a node that
does not serve the job's store (node 1; c10d's store is node 0's agent's).

Was: node 1's rank, orphaned, went on training unsupervised to the end of the run (its heartbeat looked for its agent
only when the store went, and node 0's store stayed up): node 1's launching process had ended 137 at once, node 0's
run finished 5 of 5 steps and waited 20 s for its own agent. Now the rank's heartbeat notices its agent gone while the
store answers: the rank stops as on SIGTERM, every rank checkpoints at the next step boundary and the run ends (node 0:
143, that step saved), nothing left on either node. Needs root (skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests import test_multinode
from tests.helpers import netns
from tests.test_multinode import IFNAME_ENV, REPO, env, tails
from tests.test_review_launch_tree import SLOW_STEP

pytestmark = pytest.mark.slow
TRAIN = ["recipe=cpu_zero2_two_ranks", "debug=fast", "trainer.max_steps=5", "trainer.save_every=100",
         "trainer.log_every=1", "trainer.export=false", "trainer.eval_every=0", "dataset.max_samples=160",
         "data.cutoff_len=64", "launcher.peer_timeout_s=10", IFNAME_ENV]  # fmt: skip
SLOW_S = 6  # rank 0's step 2 (rank 1 waits in its collective): node 1's agent is killed in it
workspace, cluster = test_multinode.workspace, test_multinode.cluster  # its fixtures: 2 nodes, skipped without root


def _agent(node: netns.Node) -> int:
    found = [p for p in node.pids() if "torch.distributed.run" in netns.cmdline_of(p)]
    assert len(found) == 1, [netns.cmdline_of(p) for p in node.pids()]
    return found[0]


def test_a_sigkilled_agent_on_node_1_stops_the_run_with_a_checkpoint_and_leaves_nothing(cluster, tmp_path):
    node0, node1 = cluster.nodes
    run, shim, mark = tmp_path / "run", tmp_path / "shim", tmp_path / "slow.mark"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SLOW_STEP)
    base = {"MASTER_ADDR": node0.addr, "MASTER_PORT": "29500", "NNODES": "2", "GPUS_PER_NODE": "1", "RUN_DIR": str(run),
            "DATA_CACHE": str(tmp_path / "cache"), "LAUNCHER": "torchrun", "WAIT_S": "120",
            "PYTHONPATH": f"{shim}{os.pathsep}{REPO}", "SLOW_MARK": str(mark), "SLOW_S": str(SLOW_S)}  # fmt: skip
    procs, logs = [], []
    for node in cluster.nodes:
        logs.append(tmp_path / f"{node.host}.log")
        args = ["bash", str(REPO / "launch" / "multinode_nossh.sh"), *(TRAIN if node.index == 0 else [])]
        with open(logs[-1], "wb") as fh:
            procs.append(node.popen(args, env=env({**base, "NODE_RANK": str(node.index)}), cwd=tmp_path, stdout=fh,
                                    stderr=subprocess.STDOUT))  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not mark.exists():  # rank 0 is in its long step 2
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), tails(logs)
            time.sleep(0.1)
        time.sleep(1)
        os.kill(_agent(node1), signal.SIGKILL)
        killed = time.monotonic()
        code0 = procs[0].wait(timeout=SLOW_S + 40)
        took = time.monotonic() - killed
        code1 = procs[1].wait(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = tails(logs)
    assert (code0, code1) == (143, 137), out  # node 1's launching process: its torchrun was SIGKILLed
    assert took < SLOW_S + 15, (took, out)
    assert (run / "checkpoints" / "step_2").is_dir() and (run / "checkpoints" / "latest").read_text().strip() == "step_2"
    assert "step 3/5" not in out and "Traceback" not in logs[0].read_text(errors="replace"), out
    time.sleep(1)
    left = [(n.host, netns.cmdline_of(p)) for n in cluster.nodes for p in n.pids()]
    assert not left, left  # no rank left on either node
