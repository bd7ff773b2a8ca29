"""dsrecipes.core.heartbeat on a real 2-rank gloo job on this machine (no namespaces needed).

  a peer killed (its sockets close): the rank waiting in all_reduce crashes, asks the heartbeat, names the peer
  a peer frozen (SIGSTOP: nothing closes, as with a dead node): the heartbeat notices within peer_timeout_s
  the store's host frozen: the other rank's store calls hang; the guard thread ends it
  a rank that finished (heartbeat stopped, process gone) is not reported while another still works
Each case: exit PEER_LOST_EXIT within a bounded time and <run>/failure.json naming the lost rank. The report text
and first-report-wins are unit-tested at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsrecipes.core import heartbeat
from tests.conftest import REPO, subprocess_env

TIMEOUT_S = 5


def start_pair(run_dir: Path, *mode: str):
    from dsrecipes.core.distributed import free_port

    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = subprocess_env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": port, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.helpers.heartbeat_probe", str(run_dir), str(TIMEOUT_S), *mode],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    deadline = time.monotonic() + 120
    while not all((run_dir / f"ready{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.1)
    time.sleep(1.5)  # rank 0 is in its all_reduce, both have beaten
    return procs


@pytest.mark.slow
def test_ranks_that_finish_at_different_times_are_not_taken_for_dead(tmp_path):
    procs = start_pair(tmp_path, "finish")
    outs = [p.communicate(timeout=2 * TIMEOUT_S + 60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert not (tmp_path / heartbeat.FAILURE_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("victim, how", [(1, signal.SIGKILL), (1, signal.SIGSTOP), (0, signal.SIGSTOP)],
                         ids=["peer-killed", "peer-frozen", "store-host-frozen"])
def test_a_lost_peer_ends_the_other_rank_with_a_report(tmp_path, victim, how):
    procs = start_pair(tmp_path)
    survivor = procs[1 - victim]
    try:
        os.kill(procs[victim].pid, how)
        hit = time.monotonic()
        out, _ = survivor.communicate(timeout=TIMEOUT_S + 30)
        took = time.monotonic() - hit
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert survivor.returncode == heartbeat.PEER_LOST_EXIT, out[-3000:]
    assert took < TIMEOUT_S + 10, took
    record = json.loads((tmp_path / heartbeat.FAILURE_FILE).read_text())
    if victim == 1:
        assert [w["rank"] for w in record["lost"]] == [1]
        assert "rank 1 stopped responding" in out
    else:
        assert record["lost"] == [] and "store at 127.0.0.1" in record["reason"]


def test_describe_failure_groups_ranks_by_node():
    record = {"lost": [{"rank": 2, "node": 1, "host": "gpu7", "addr": "10.0.0.7"},
                       {"rank": 3, "node": 1, "host": "gpu7", "addr": "10.0.0.7"}], "reason": "no heartbeat for 30 s"}  # fmt: skip
    assert heartbeat.describe_failure(record) == (
        "node 1 (gpu7, 10.0.0.7) failed: ranks 2, 3 stopped responding (no heartbeat for 30 s)")
    assert heartbeat.describe_failure({"lost": [], "reason": "store gone"}) == "store gone"


def test_the_first_failure_report_stands(tmp_path):
    first = {"lost": [{"rank": 3}], "reason": "first"}
    assert heartbeat.write_failure(tmp_path, first) == first
    assert heartbeat.write_failure(tmp_path, {"lost": [], "reason": "second"}) == first
    assert heartbeat.read_failure(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [heartbeat.FAILURE_FILE]  # no temp files left


def test_no_heartbeat_for_one_process_or_when_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert heartbeat.start(tmp_path, 0, 1, 30) is None
    assert heartbeat.start(tmp_path, 0, 4, 0) is None
