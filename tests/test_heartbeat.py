"""dsrecipes.core.heartbeat on a real 2-rank gloo job on this machine (no namespaces needed).

  a peer killed (its sockets close): the rank waiting in all_reduce crashes, asks the heartbeat, names the peer
  a peer frozen (SIGSTOP: nothing closes, as with a dead node): the heartbeat notices within peer_timeout_s
  the store's host frozen: the other rank's store calls hang; the guard thread ends it
  a rank that finished (heartbeat stopped, process gone) is not reported while another still works
The four jobs run side by side (one start-up, the bounds overlap). Each case: exit PEER_LOST_EXIT within a bounded time and <run>/failure.json naming the lost rank. The report text
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
from typing import Dict, List, Tuple

import pytest

from dsrecipes.core import heartbeat
from tests.conftest import REPO, subprocess_env

TIMEOUT_S = 5


def launch_pair(run_dir: Path, *mode: str) -> List[subprocess.Popen]:
    from dsrecipes.core.distributed import free_port

    run_dir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = subprocess_env({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": port, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})  # fmt: skip
        with open(run_dir / f"out{rank}.txt", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.helpers.heartbeat_probe", str(run_dir), str(TIMEOUT_S), *mode],
                                          env=env, stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
    return procs


def wait_ready(pairs: Dict[str, Tuple[Path, List[subprocess.Popen]]]) -> None:
    deadline = time.monotonic() + 120
    for run_dir, procs in pairs.values():
        while not all((run_dir / f"ready{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(p.poll() in (None, 0) for p in procs), [p.poll() for p in procs]
            time.sleep(0.1)
    time.sleep(1.5)  # every rank 0 is in its all_reduce, all have beaten


LOST = {"peer-killed": (1, signal.SIGKILL), "peer-frozen": (1, signal.SIGSTOP),
        "store-host-frozen": (0, signal.SIGSTOP)}  # case: (victim rank, signal)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """All four 2-rank jobs at once (each its own store port and run directory): started together, then every fault
    injected at the same moment, so the processes start once for all and the bounds run side by side. Yields
    {case: (run dir, [rank 0, rank 1], exit time of each rank (None: still running at the bound), fault time)}."""
    root = tmp_path_factory.mktemp("heartbeat")
    launched = {"finish": (root / "finish", launch_pair(root / "finish", "finish"))}
    launched.update({name: (root / name, launch_pair(root / name)) for name in LOST})
    everyone = [p for _, procs in launched.values() for p in procs]
    try:
        wait_ready(launched)
        hit = time.monotonic()
        for name, (victim, how) in LOST.items():
            os.kill(launched[name][1][victim].pid, how)
        ended: Dict[int, float] = {}
        deadline = hit + 2 * TIMEOUT_S + 60
        survivors = [launched[n][1][1 - v] for n, (v, _) in LOST.items()] + launched["finish"][1]
        while time.monotonic() < deadline and any(p.pid not in ended for p in survivors):
            for p in survivors:
                if p.pid not in ended and p.poll() is not None:
                    ended[p.pid] = time.monotonic()
            time.sleep(0.05)
        yield {name: (run_dir, procs, [ended.get(p.pid) for p in procs], hit)
               for name, (run_dir, procs) in launched.items()}
    finally:
        for p in everyone:
            p.kill()
            p.wait()


def output(run_dir: Path, rank: int) -> str:
    return (run_dir / f"out{rank}.txt").read_text(errors="replace")


@pytest.mark.slow
def test_ranks_that_finish_at_different_times_are_not_taken_for_dead(pairs):
    run_dir, procs, ended, _ = pairs["finish"]
    outs = [output(run_dir, r) for r in (0, 1)]
    assert None not in ended and [p.returncode for p in procs] == [0, 0], outs
    assert not (run_dir / heartbeat.FAILURE_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LOST))
def test_a_lost_peer_ends_the_other_rank_with_a_report(pairs, case):
    run_dir, procs, ended, hit = pairs[case]
    victim = LOST[case][0]
    survivor = 1 - victim
    out = output(run_dir, survivor)
    assert ended[survivor] is not None, out[-3000:]
    assert procs[survivor].returncode == heartbeat.PEER_LOST_EXIT, out[-3000:]
    took = ended[survivor] - hit
    assert took < TIMEOUT_S + 10, took
    record = json.loads((run_dir / heartbeat.FAILURE_FILE).read_text())
    if victim == 1:
        assert [w["rank"] for w in record["lost"]] == [1]
        assert "rank 1 stopped responding" in out
    else:
        # rank 0 serves the store: since 49b4880 the report names it as the lost rank (was: lost [])
        assert [w["rank"] for w in record["lost"]] == [0] and "store at 127.0.0.1" in record["reason"], record


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
