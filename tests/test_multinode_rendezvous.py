"""A node that never starts ends the run within launcher.rendezvous_timeout_s, naming it (issue 43 item 5).

2 network-namespace nodes (tests/helpers/netns.py, as tests/test_multinode.py): launch/multinode_nossh.sh runs on
node 0 only, node 1's launcher never starts. Node 0's ranks wait at the rendezvous with a line saying for whom, then
the run ends with one message naming ranks 2, 3 on node 1, exit 2, no traceback, no rank left on node 0. Needs root
(skipped with the reason otherwise) and runs with the fault matrix (DSRECIPES_FAULT_MATRIX=1): a launch of its own.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tests.helpers import netns
from tests.test_multinode import IFNAME_ENV, REPO, TRAIN, env, tails

pytestmark = pytest.mark.slow
TIMEOUT_S = 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not os.environ.get("DSRECIPES_FAULT_MATRIX"):
        pytest.skip("with the fault matrix: DSRECIPES_FAULT_MATRIX=1")
    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(reason)
    with netns.Cluster(2, tmp_path_factory.mktemp("rdzv-cluster")) as c:
        yield c


def test_a_node_that_never_starts_ends_the_run_naming_it(cluster, tmp_path):
    node0 = cluster.nodes[0]
    run = tmp_path / "run"
    base = {"MASTER_ADDR": node0.addr, "MASTER_PORT": "29500", "NNODES": "2", "GPUS_PER_NODE": "2", "RUN_DIR": str(run),
            "DATA_CACHE": str(tmp_path / "cache"), "LAUNCHER": "deepspeed_multinode", "NODE_RANK": "0"}  # fmt: skip
    log = tmp_path / "node0.log"
    args = ["bash", str(REPO / "launch" / "multinode_nossh.sh"), *TRAIN, IFNAME_ENV,
            f"launcher.rendezvous_timeout_s={TIMEOUT_S}"]
    with open(log, "wb") as fh:
        proc = node0.popen(args, env=env(base), cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and "waiting at the rendezvous" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, tails([log])
            time.sleep(0.2)
        waiting = time.monotonic()
        code = proc.wait(timeout=TIMEOUT_S + 30)
        took = time.monotonic() - waiting
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text(errors="replace")
    assert code == 2, (code, out[-4000:])
    assert "ranks 2, 3 (node 1) not arrived yet" in out, out[-4000:]
    assert f"launcher.rendezvous_timeout_s={TIMEOUT_S}: ranks 2, 3 (node 1) never reached the rendezvous" in out
    assert "Traceback" not in out and "frame #" not in out and took < TIMEOUT_S + 15, (took, out[-4000:])
    time.sleep(1)
    assert not [p for p in node0.pids() if "dsrecipes" in " ".join(netns.cmdline_of(p))], "a process left"
