"""`dsrecipes node RUN --node-rank N` (dsrecipes/run/join.py): nodes > 0 of a multi-node run without ssh.

Was: launch/multinode_nossh.sh on NODE_RANK > 0 slept 5 s ("let node 0 remove a stale launch.txt"), waited for
RUN/launch.txt without a word, and ran the text of its node's line with `bash -c`, unsupervised. Now it waits for
this attempt's run directory (a line every NOTE_S, one message at the bound, exit 2; an earlier attempt's launch.txt
is not taken), builds its command from the run's config with node 0's builder (what launch.txt shows; a launch.txt
whose line was replaced is never run) and supervises it as node 0 does. On 2 network-namespace nodes (root): SIGTERM
to node 1's `dsrecipes node` reaches its ranks, every rank saves at the next step boundary, both nodes end 143.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from dsrecipes import cli
from dsrecipes.core.heartbeat import FAILURE_FILE
from dsrecipes.core.locks import ExclusiveLock
from dsrecipes.core.rundir import LOCK_FILE, write_config
from dsrecipes.core.runplan import RunPlan, write_plan
from dsrecipes.core.typed import config_to_dict
from dsrecipes.run import join, launch
from dsrecipes.run.launch.plan import LAUNCH_FILE
from tests import test_multinode
from tests.helpers import netns
from tests.test_multinode import REPO, env, tails
from tests.test_review_launch_tree import SLOW_STEP
from tests.test_review_multinode_agent import TRAIN as SLOW_TRAIN  # 5 steps, 1 rank per node, peer timeout 10 s

MULTI = ["launcher.num_nodes=2", "launcher.num_gpus=2", "launcher.master_addr=10.0.0.1", "launcher.master_port=29511",
         "trainer.device=cpu"]  # fmt: skip


def node(*argv: str) -> int:
    return cli.main(["node", *argv])


def written_run(make_cfg, run: Path, *overrides: str) -> ExclusiveLock:
    """What node 0 writes (config.yaml, plan.json, launch.txt through `launch` as a dry run; then config.yaml as a
    real run's, launch.txt the newest), holding the run's lock as its launching process does; returns the lock."""
    run.mkdir(parents=True, exist_ok=True)
    cfg = make_cfg(*overrides, f"trainer.output_dir={run}", "launcher.dry_run=true")
    lock = ExclusiveLock(run / LOCK_FILE).acquire()
    write_config(run, config_to_dict(cfg))
    write_plan(run, RunPlan(world_size=4, num_nodes=2, data_kind="map", rows=64, steps_per_epoch=4, total_steps=4,
                            data_fingerprint="f"))  # fmt: skip
    launch.launch(cfg, run)
    write_config(run, config_to_dict(dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher,
                                                                                          dry_run=False))))
    os.utime(run / LAUNCH_FILE)
    return lock


def node_line(text: str, node_rank: int) -> str:
    """launch.txt's command for `node_rank` (the line after `# node N`; torchrun: its one command)."""
    lines = text.splitlines()
    if f"# node {node_rank}" in lines:
        return lines[lines.index(f"# node {node_rank}") + 1]
    return [ln for ln in lines if not ln.startswith("#")][0]


def test_the_wait_says_for_what_and_ends_at_its_bound_with_one_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(join, "NOTE_S", 0.3)
    run = tmp_path / "run"  # node 0 has not even created it
    started = time.monotonic()
    assert node(str(run), "--node-rank", "1", "--wait-s", "1.5") == 2
    took = time.monotonic() - started
    err = capsys.readouterr().err
    waits = [ln for ln in err.splitlines() if ln.startswith(f"node 1: waiting for node 0 to write {run / LAUNCH_FILE}")]
    assert len(waits) >= 3 and waits[0].endswith("(0 s of 1.5 s)"), err
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert errors == [ln for ln in err.splitlines() if not ln.startswith("node 1: waiting")], err
    assert len(errors) == 1 and "node 1: waited 1.5 s (--wait-s, WAIT_S) for node 0 to write" in errors[0], err
    assert f"and {run} does not exist here: RUN_DIR must be on storage every node sees at the same path" in errors[0]
    assert "Traceback" not in err and took < 5
    assert not run.exists()  # nothing made where node 0 will claim the directory


def test_an_earlier_attempts_launch_txt_is_not_taken(make_cfg, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    lock = written_run(make_cfg, run, "launcher=deepspeed_multinode", *MULTI)
    assert join.ready(run) is None
    lock.release()  # that attempt ended; its launch.txt stays (the lock file's release may be its newer write)
    assert join.ready(run) is not None
    lock = ExclusiveLock(run / LOCK_FILE).acquire()  # the next attempt's node 0 holds the directory, composing
    old = (run / LAUNCH_FILE).stat().st_mtime_ns
    os.utime(run / LOCK_FILE, ns=(old + 10**6, old + 10**6))  # (later, whatever the filesystem's clock granularity)
    assert join.ready(run) == f"node 0 to write {run / LAUNCH_FILE} (the one there is from an earlier attempt)"
    assert node(str(run), "--node-rank", "1", "--wait-s", "0.5") == 2
    assert "from an earlier attempt); nothing was started on this node" in capsys.readouterr().err
    (run / LAUNCH_FILE).write_text((run / LAUNCH_FILE).read_text())  # this attempt's
    os.utime(run / LAUNCH_FILE, ns=(old + 2 * 10**6, old + 2 * 10**6))
    assert join.ready(run) is None
    (run / FAILURE_FILE).write_text("{}")  # an earlier attempt's report, node 0 about to remove it
    os.utime(run / FAILURE_FILE, ns=(old, old))
    assert join.ready(run) == f"node 0 to remove {run / FAILURE_FILE} of an earlier attempt"
    os.utime(run / FAILURE_FILE, ns=(old + 3 * 10**6, old + 3 * 10**6))  # one of this attempt's ranks wrote it
    assert join.ready(run) == f"node 0's next attempt (this one failed: {run / FAILURE_FILE})"
    (run / FAILURE_FILE).unlink()
    assert join.ready(run) is None
    lock.release()


@pytest.mark.parametrize("overrides, said", [
    (["launcher=deepspeed", "launcher.num_gpus=2"], "a run of launcher=deepspeed with launcher.num_nodes=1"),
    (["launcher=torchrun", "launcher.num_gpus=2"], "a run of launcher=torchrun with launcher.num_nodes=1"),
    (["launcher=torchrun", *MULTI], None),
])  # fmt: skip
def test_refused_without_a_node_of_that_rank(make_cfg, tmp_path, capsys, overrides, said):
    run = tmp_path / "run"
    lock = written_run(make_cfg, run, *overrides)
    try:
        if said is not None:
            assert node(str(run), "--node-rank", "1", "--wait-s", "0") == 2
            err = capsys.readouterr().err
            assert said in err and "`dsrecipes node` joins runs of launcher=deepspeed_multinode or" in err, err
        else:
            assert node(str(run), "--node-rank", "2", "--wait-s", "0") == 2
            err = capsys.readouterr().err
            assert "error: --node-rank 2: " in err and "is a run of 2 nodes (node ranks 0 to 1" in err, err
        assert node(str(run), "--node-rank", "0") == 2
        err = capsys.readouterr().err
        assert "error: --node-rank 0: node 0 runs the launching process itself" in err and "Traceback" not in err
        assert not (run / "logs").exists()  # nothing started
    finally:
        lock.release()


@pytest.mark.parametrize("launcher", ["deepspeed_multinode", "torchrun"])
def test_node_1_runs_what_launch_txt_shows_for_node_1(make_cfg, tmp_path, monkeypatch, launcher):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)  # (node 0 and 1: the same environment)
    run = tmp_path / "run"
    lock = written_run(make_cfg, run, f"launcher={launcher}", *MULTI, "+launcher.env.GLOO_SOCKET_IFNAME=dsr0")
    try:
        cfg = join.node_config(run, 1)
        commands = join.node_commands(cfg, run)
    finally:
        lock.release()
    assert cfg.launcher.node_rank == 1 and len(commands) == 1
    shown = node_line((run / LAUNCH_FILE).read_text(), 1)
    assert commands[0].shell() == shown
    if launcher == "deepspeed_multinode":
        assert "--node_rank=1 " in shown and "--master_port=29511 " in shown
    else:
        assert "--rdzv_endpoint 10.0.0.1:29511 " in shown


def test_a_replaced_line_in_launch_txt_is_never_run(make_cfg, tmp_path, monkeypatch, capsys):
    """launch.txt is on shared storage: whoever can write it must not choose what node 1 runs."""
    run, pwned = tmp_path / "run", tmp_path / "pwned"
    lock = written_run(make_cfg, run, "launcher=deepspeed_multinode", *MULTI)
    planned = join.node_commands(join.node_config(run, 1), run)
    text = (run / LAUNCH_FILE).read_text()
    hostile = text.replace(node_line(text, 1), f"touch {pwned}") + f"touch {pwned}\n"
    (run / LAUNCH_FILE).write_text(hostile)
    ran: List[object] = []
    monkeypatch.setattr(join, "run_subprocess", lambda cmd, *a, **k: ran.append(cmd) or 0)
    monkeypatch.setattr(join, "remove_shm_buffers", lambda port: None)
    try:
        assert node(str(run), "--node-rank", "1", "--wait-s", "5") == 0
    finally:
        lock.release()
    lock_env = {"DSRECIPES_NODE_LOCK": str(run / ".dsrecipes.node1.lock")}  # (its ranks watch it: rank/worker.py)
    assert [dataclasses.asdict(c) for c in ran] == [dataclasses.asdict(dataclasses.replace(c, env={**c.env, **lock_env}))
                                                    for c in planned]
    assert "touch" not in " ".join(ran[0].argv) and not pwned.exists()
    err = capsys.readouterr().err
    assert "node 1: its ranks finished (exit 0)" in err and str(run / "logs" / "launcher-node1.log") in err, err


def test_a_launcher_killed_by_dsrecipes_after_its_ranks_ended_is_named_not_as_a_signal(tmp_path, monkeypatch, capsys):
    """run_subprocess kills a launcher that did not exit after its ranks ended (its -9 is ours): node 1's last line
    says so (was: 'its launcher was killed by SIGKILL', exit 137, the OOM killer's look)."""
    said = "the launcher (pid 7, torch.distributed.run) did not exit 20 s after its ranks ended and was killed by dsrecipes"
    monkeypatch.setattr(join, "launcher_hung", lambda run_dir: said)
    monkeypatch.setattr(join.stopping, "requested", lambda: None)
    monkeypatch.setattr(join.stopping, "cause", lambda: None)
    assert join.conclude(tmp_path, 1, -9, tmp_path / "launcher-node1.log") == 1
    err = capsys.readouterr().err
    assert f"node 1: {said}" in err and "SIGKILL" not in err, err


# ---------------------------------------------------------------------------------------------------------------
# Two network-namespace nodes (root), 1 rank each, launch/multinode_nossh.sh on both: node 1 runs `dsrecipes node`.

workspace, cluster = test_multinode.workspace, test_multinode.cluster  # its 2 nodes; skipped without root
CRASH_STEP = SLOW_STEP.replace("def slow(s):", "def slow(s):\n                if s.rank == 1 and s.state.step == 2:\n"
                               "                    raise RuntimeError('injected on rank 1')")  # (node 1's rank)


def start_both(cluster: netns.Cluster, tmp_path: Path, launcher: str, shim_text: str) -> List[subprocess.Popen]:
    """The script on both nodes (overrides on node 0), rank 0 sleeping SLOW_S after step 1 (SLOW_STEP's mark file:
    tmp_path/slow.mark); logs: tmp_path/node0.log, node1.log."""
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(shim_text)
    return [start_node(cluster, n.index, tmp_path, launcher, tmp_path / f"{n.host}.log") for n in cluster.nodes]


def start_node(cluster: netns.Cluster, index: int, tmp_path: Path, launcher: str, log: Path,
               extra: Optional[Dict[str, str]] = None, train: Sequence[str] = SLOW_TRAIN) -> subprocess.Popen:
    """The script on node `index` (node 0: the overrides `train`); `extra`: that node's own environment on top."""
    n = cluster.nodes[index]
    base = {"MASTER_ADDR": cluster.nodes[0].addr, "MASTER_PORT": "29500", "NNODES": "2", "GPUS_PER_NODE": "1",
            "RUN_DIR": str(tmp_path / "run"), "DATA_CACHE": str(tmp_path / "cache"), "LAUNCHER": launcher,
            "WAIT_S": "120", "PYTHONPATH": f"{tmp_path / 'shim'}{os.pathsep}{REPO}",
            "SLOW_MARK": str(tmp_path / "slow.mark"), "SLOW_S": "8", "NODE_RANK": str(n.index), **(extra or {})}  # fmt: skip
    with open(log, "wb") as fh:
        return n.popen(["bash", str(REPO / "launch" / "multinode_nossh.sh"), *(train if n.index == 0 else [])],
                       env=env(base), cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT)


def stop_all(procs: List[subprocess.Popen]) -> None:
    """A failed test's processes killed (Cluster.close ends whatever they leave in the namespaces)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def ended(cluster: netns.Cluster, procs: List[subprocess.Popen], timeout: float = 60) -> List[int]:
    """Both exit codes; whatever is still running when the test fails is killed. Nothing is left on either node."""
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        stop_all(procs)
    time.sleep(1)
    left = [(n.host, netns.cmdline_of(p)) for n in cluster.nodes for p in n.pids()]
    assert not left, left
    return codes


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [
    pytest.param("deepspeed_multinode", marks=pytest.mark.skipif(
        not os.environ.get("DSRECIPES_FAULT_MATRIX"), reason="with the fault matrix: DSRECIPES_FAULT_MATRIX=1 (CI "
        "time: node 1's deepspeed launcher under `dsrecipes node` is stopped with a checkpoint in CI by "
        "tests/test_review_node_join.py's SIGKILL case, SIGTERM's forwarding by node 0's tests)")),
    "torchrun"])
def test_sigterm_to_node_1_stops_every_rank_with_a_checkpoint(cluster, tmp_path, launcher):
    """Rank 0 sleeps in step 2 (the others wait in its collective); node 1's `dsrecipes node` gets SIGTERM: its
    ranks get it, every rank stops at the step boundary with the step-2 checkpoint, both nodes end 143, node 1 says
    so in one line and shows no traceback, nothing is left on either node. Then the next attempt, node 1 first."""
    procs = start_both(cluster, tmp_path, launcher, SLOW_STEP)
    logs = [tmp_path / f"{n.host}.log" for n in cluster.nodes]
    deadline = time.monotonic() + 240
    while not (tmp_path / "slow.mark").exists():
        if time.monotonic() > deadline or not all(p.poll() is None for p in procs):
            stop_all(procs)
            pytest.fail(tails(logs))
        time.sleep(0.1)
    time.sleep(1)
    joined = [p for p in cluster.nodes[1].pids() if netns.cmdline_of(p)[2:4] == ["dsrecipes", "node"]]
    assert joined == [procs[1].pid], [netns.cmdline_of(p) for p in cluster.nodes[1].pids()]  # (the script exec'd it)
    os.kill(procs[1].pid, signal.SIGTERM)
    codes = ended(cluster, procs)
    out, out1 = tails(logs), logs[1].read_text(errors="replace")
    assert codes == [143, 143], out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_2", out
    assert "node 1: waiting for node 0 to write" in out1 and "node 1: stopped by SIGTERM" in out1, out1
    assert "Traceback" not in out1 and "Resume with:" in logs[0].read_text(errors="replace"), out
    assert_resumes_with_node_1_first(cluster, tmp_path, launcher)


def assert_resumes_with_node_1_first(cluster: netns.Cluster, tmp_path: Path, launcher: str) -> None:
    """The next attempt in the same RUN_DIR, node 1 started first: the earlier attempt's launch.txt is there, but
    node 1 starts nothing until node 0 holds the directory and wrote its own; then both resume from step 2."""
    logs = [tmp_path / f"{n.host}-again.log" for n in cluster.nodes]
    second = start_node(cluster, 1, tmp_path, launcher, logs[1])
    procs = [second]
    try:
        deadline = time.monotonic() + 60
        while "node 1: waiting for node 0" not in logs[1].read_text(errors="replace"):
            assert second.poll() is None and time.monotonic() < deadline, logs[1].read_text(errors="replace")
            time.sleep(0.2)
        time.sleep(3)
        assert second.poll() is None and "starting its ranks" not in logs[1].read_text(errors="replace")
        assert [netns.cmdline_of(p) for p in cluster.nodes[1].pids()][0][2:4] == ["dsrecipes", "node"]
        assert len(cluster.nodes[1].pids()) == 1  # no launcher, no rank
    except BaseException:
        stop_all(procs)
        raise
    procs.insert(0, start_node(cluster, 0, tmp_path, launcher, logs[0]))
    codes = ended(cluster, procs, timeout=300)
    out = tails(logs)
    assert codes == [0, 0], out
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step_2'}" in logs[0].read_text(errors="replace"), out
    assert "node 1: its ranks finished (exit 0)" in logs[1].read_text(errors="replace"), out


@pytest.mark.slow
def test_a_rank_failing_on_node_1_is_one_line_there_without_torchs_traceback(cluster, tmp_path):
    """torchrun: node 1's rank raises in step 2. torchrun's agent prints its ChildFailedError traceback and box; on
    node 1 they go to logs/launcher-node1.log, the console says in one line how node 1's ranks ended and the run's
    first failure; node 0 says it as for a single node. (Was: node 1's console showed torch's traceback.)"""
    procs = start_both(cluster, tmp_path, "torchrun", CRASH_STEP)
    codes = ended(cluster, procs, timeout=300)
    logs = [tmp_path / f"{n.host}.log" for n in cluster.nodes]
    out, out1 = tails(logs), logs[1].read_text(errors="replace")
    assert codes[0] != 0 and codes[1] != 0, out
    assert "injected on rank 1" in logs[0].read_text(errors="replace"), out
    last = [ln for ln in out1.splitlines() if ln.startswith("node 1: ")][-1]
    assert last.startswith("node 1: its ranks ended with exit code ") and "injected on rank 1" in last, out1
    assert "Traceback" not in out1 and "ChildFailedError" not in out1, out1
    assert "ChildFailedError" in (tmp_path / "run" / "logs" / "launcher-node1.log").read_text(errors="replace")
