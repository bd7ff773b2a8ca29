"""A sceptical cluster user's `dsrecipes node RUN --node-rank N` (dsrecipes/run/join.py), without network namespaces.

Found: (1) the waiting node probed node 0's run lock every 0.5 s while node 0 prepared its data, and a probe holds the
lock for an instant: node 0's claim of its run directory taken in that instant is refused ('in use by another run');
(2) a dry run of node 0 (launcher.dry_run=true: commands written, the lock held for a moment) was joined: node 1
started ranks for a run that never starts; (3) two `dsrecipes node` with the same --node-rank both started ranks; (4) a node 1 that came while node 0's attempt
was failing (a fresh failure.json) started ranks only to have them stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest
import yaml

from dsrecipes.core.locks import ExclusiveLock
from dsrecipes.core.rundir import LOCK_FILE
from dsrecipes.run import join
from dsrecipes.run.launch.plan import LAUNCH_FILE
from tests import test_multinode
from tests.helpers import netns
from tests.test_multinode import tails
from tests.test_node_join import MULTI, node, start_node, stop_all, written_run
from tests.test_review_launch_tree import SLOW_STEP
from tests.test_review_multinode_agent import TRAIN as SLOW_TRAIN

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_start(monkeypatch) -> List[object]:
    """What `dsrecipes node` would start (nothing runs)."""
    ran: List[object] = []
    monkeypatch.setattr(join, "run_subprocess", lambda cmd, *a, **k: ran.append(cmd) or 0)
    monkeypatch.setattr(join, "remove_shm_buffers", lambda port: None)
    return ran


def probes(monkeypatch) -> List[Path]:
    seen: List[Path] = []
    real = join.launcher_alive
    monkeypatch.setattr(join, "launcher_alive", lambda run: seen.append(run) or real(run))
    return seen


def test_the_wait_leaves_node_0s_lock_alone_while_node_0_prepares(make_cfg, tmp_path, monkeypatch):
    """Node 0 holds its lock and tokenizes (no launch.txt yet): no probe of the lock. After a SIGKILLed attempt (its
    launch.txt newer than its never-released lock) one probe, not one every POLL_S while node 0 restarts."""
    run, seen = tmp_path / "run", probes(monkeypatch)
    run.mkdir()
    lock = ExclusiveLock(run / LOCK_FILE).acquire()
    dead: set = set()
    for _ in range(20):
        assert join.ready(run, dead) == f"node 0 to write {run / LAUNCH_FILE}"
    assert seen == []  # (was: 20 probes, each one able to make node 0's claim fail)
    lock.release()
    lock = written_run(make_cfg, run, "launcher=deepspeed_multinode", *MULTI)
    assert join.ready(run, dead) is None and len(seen) == 1
    os.close(lock.fd)  # as a SIGKILL: released, the holder's line not truncated
    for _ in range(20):
        assert "no launching process holds" in join.ready(run, dead)
    assert len(seen) == 2
    (run / "result.json").write_text("{}")  # node 1 came after the run ended
    assert join.ready(run, set()) == f"node 0's next attempt (the last one has ended: {run / 'result.json'})"


def test_an_attempt_that_is_failing_is_not_joined(make_cfg, tmp_path, no_start, monkeypatch):
    """failure.json newer than launch.txt: a rank of this attempt reported the run's failure; node 0's launching
    process still holds the lock while it stops the others. Node 1 waits for the next attempt instead of starting."""
    run = tmp_path / "run"
    lock = real_run(make_cfg, run)
    written = (run / LAUNCH_FILE).stat().st_mtime_ns
    (run / "failure.json").write_text("{}")
    os.utime(run / "failure.json", ns=(written + 10**6, written + 10**6))
    try:
        assert join.ready(run, set()) == f"node 0's next attempt (this one failed: {run / 'failure.json'})"
        assert node(str(run), "--node-rank", "1", "--wait-s", "0.5") == 2 and no_start == []
    finally:
        lock.release()


def real_run(make_cfg, run: Path, *overrides: str) -> ExclusiveLock:
    return written_run(make_cfg, run, "launcher=deepspeed_multinode", *MULTI, *overrides)


def edit_config(run: Path, change) -> None:
    data = yaml.safe_load((run / "config.yaml").read_text())
    change(data)
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def test_a_second_node_with_the_same_rank_waits_for_the_first_within_its_bound(make_cfg, tmp_path, no_start, capsys,
                                                                              monkeypatch):
    """NODE_RANK=1 given twice, or node 1's `dsrecipes node` of the lost attempt still ending its ranks: the second
    one waits for the first (saying who), up to --wait-s, and starts nothing meanwhile; it joins once the first ends."""
    monkeypatch.setattr(join, "NOTE_S", 0.3)
    run = tmp_path / "run"
    lock = real_run(make_cfg, run)
    first = ExclusiveLock(run / join.NODE_LOCK.format(1), {"node_rank": 1}).acquire()  # node 1 runs its ranks
    try:
        assert node(str(run), "--node-rank", "1", "--wait-s", "1") == 2
        err = capsys.readouterr().err
        other = f"the other `dsrecipes node --node-rank 1` of {run} to end (pid {os.getpid()} on "
        assert no_start == [] and f"node 1: waiting for {other}" in err, err
        assert f"error: node 1: waited 1 s (--wait-s, WAIT_S) for {other}" in err and "Traceback" not in err, err
        assert "Give every node its own NODE_RANK (1 to NNODES-1), or wait for that one to end" in err, err
        threading.Timer(0.8, first.release).start()
        assert node(str(run), "--node-rank", "1", "--wait-s", "10") == 0 and len(no_start) == 1
    finally:
        lock.release()


@pytest.mark.parametrize("change, said", [
    (lambda c: c["launcher"]["env"].update(LD_PRELOAD="/tmp/x.so"), "launcher.env.LD_PRELOAD"),
    (lambda c: c["launcher"].update(extra_args=["--module", "evil"]), "--module"),
    (lambda c: c["launcher"].update(extra_args=["/tmp/evil.py"]), "evil.py"),
    (lambda c: c["launcher"].update(dry_run=True), "is a dry run (launcher.dry_run=true)"),  # (was: joined)
])  # fmt: skip
def test_config_yaml_outside_the_allow_lists_is_refused(make_cfg, tmp_path, no_start, capsys, change, said):
    """Shared storage: whoever can write config.yaml must not choose what node 1 exports or runs; and a dry run of
    node 0 (config.yaml and launch.txt written, the lock held a moment, no rank started) is not joined."""
    run = tmp_path / "run"
    lock = real_run(make_cfg, run)
    edit_config(run, change)
    os.utime(run / LAUNCH_FILE)
    try:
        assert node(str(run), "--node-rank", "1", "--wait-s", "1") == 2
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert no_start == [] and said in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ln.startswith("error")]) == 1, err


def test_a_symlinked_config_or_a_foreign_directory_is_refused(make_cfg, tmp_path, no_start, capsys):
    """A config.yaml that links elsewhere is read through the link, as the ranks read it (load_run_config): what it
    holds must pass the same allow-lists. A directory without node 0's plan.json is no run to join."""
    run, elsewhere = tmp_path / "run", tmp_path / "theirs.yaml"
    lock = real_run(make_cfg, run)
    try:
        edit_config(run, lambda c: c["launcher"]["env"].update(PYTHONPATH="/tmp/evil"))
        (run / "config.yaml").rename(elsewhere)
        (run / "config.yaml").symlink_to(elsewhere)
        os.utime(run / LAUNCH_FILE)
        assert node(str(run), "--node-rank", "1", "--wait-s", "1") == 2
        err = capsys.readouterr().err
        assert "launcher.env.PYTHONPATH" in err and "Traceback" not in err, err
        (run / "config.yaml").unlink()
        elsewhere.rename(run / "config.yaml")
        edit_config(run, lambda c: c["launcher"]["env"].pop("PYTHONPATH"))
        (run / "plan.json").unlink()  # someone's directory with a config.yaml, not a dsrecipes run
        os.utime(run / LAUNCH_FILE)
        assert node(str(run), "--node-rank", "1", "--wait-s", "1") == 2
        err = capsys.readouterr().err
        assert "plan.json: missing" in err and "Traceback" not in err, err
    finally:
        lock.release()
    assert no_start == []


def test_the_next_attempt_with_other_overrides_is_joined_with_its_own_config(make_cfg, tmp_path, no_start):
    """Attempt 2 in the same RUN_DIR with more steps: while node 0 writes it (config.yaml new, launch.txt old) node 1
    waits; then it builds its ranks from the new config, never the old one."""
    run = tmp_path / "run"
    real_run(make_cfg, run, "trainer.max_steps=5").release()
    lock = ExclusiveLock(run / LOCK_FILE).acquire()  # attempt 2 (the script removes launch.txt; here it stays)
    edit_config(run, lambda c: c["trainer"].update(max_steps=7))
    old = (run / LAUNCH_FILE).stat().st_mtime_ns
    os.utime(run / LOCK_FILE, ns=(old + 10**6, old + 10**6))
    assert join.ready(run, set()) == f"node 0 to write {run / LAUNCH_FILE} (the one there is from an earlier attempt)"
    os.utime(run / LAUNCH_FILE, ns=(old + 2 * 10**6, old + 2 * 10**6))
    try:
        assert join.node_config(run, 1).trainer.max_steps == 7
        assert node(str(run), "--node-rank", "1", "--wait-s", "1") == 0 and len(no_start) == 1
    finally:
        lock.release()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_while_waiting_is_one_line_and_leaves_nothing(tmp_path, signum):
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "dsrecipes", "node", str(run), "--node-rank", "1", "--wait-s", "60"],
                            cwd=tmp_path, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    first = proc.stderr.readline()
    assert first.startswith(f"node 1: waiting for node 0 to write {run / LAUNCH_FILE}"), first
    time.sleep(0.3)
    proc.send_signal(signum)
    rest = proc.stderr.read()
    assert proc.wait(timeout=20) == 128 + signum, rest
    assert rest.strip().count("\n") == 0 and "Traceback" not in rest, rest
    assert not run.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Two network-namespace nodes (root), 1 rank each, launch/multinode_nossh.sh on both.

workspace, cluster = test_multinode.workspace, test_multinode.cluster  # its 2 nodes; skipped without root


def slow_step_shim(tmp_path: Path) -> None:
    """Rank 0 sleeps SLOW_S after step 1 (tmp_path/slow.mark says when), the others wait in its collective."""
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "sitecustomize.py").write_text(SLOW_STEP)


def in_step_2(tmp_path: Path, procs: List[subprocess.Popen], logs: List[Path]) -> None:
    """Until rank 0 sleeps in step 2 (and a second more); fails with the logs if a node ends first."""
    deadline = time.monotonic() + 240
    while not (tmp_path / "slow.mark").exists():
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, tails(logs)
        time.sleep(0.1)
    time.sleep(1)


def ranks_on(n: netns.Node) -> List[int]:
    """Its ranks (`python -u -m dsrecipes.rank.worker ...`; the launcher's command line names the module too)."""
    return [p for p in n.pids() if netns.cmdline_of(p)[1:4] == ["-u", "-m", "dsrecipes.rank.worker"]]


@pytest.mark.slow
def test_node_1_late_with_its_own_environment_then_node_0_dies(cluster, tmp_path):
    """Node 1 starts while node 0's rank already waits at the rendezvous, with an export of its own (its ranks get
    it, node 0's do not); then node 0 dies in step 2 (link cut, every process SIGKILLed: a lost machine). Node 1 ends
    within a bound, its last line says why, nothing is left on it."""
    node0, node1 = cluster.nodes
    slow_step_shim(tmp_path)
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = [start_node(cluster, 0, tmp_path, "deepspeed_multinode", logs[0])]
    try:
        deadline = time.monotonic() + 240
        while not ranks_on(node0):  # node 0 prepared the data and started its rank: it waits for node 1's
            assert procs[0].poll() is None and time.monotonic() < deadline, tails(logs)
            time.sleep(0.2)
        time.sleep(5)
        procs.append(start_node(cluster, 1, tmp_path, "deepspeed_multinode", logs[1],
                                {"NCCL_SOCKET_IFNAME": "node1only"}))
        while not (tmp_path / "slow.mark").exists():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, tails(logs)
            time.sleep(0.1)
        time.sleep(1)
        envs = [netns.environ_of(p) for p in ranks_on(node1)]
        assert [e.get("NCCL_SOCKET_IFNAME") for e in envs] == ["node1only"], envs
        assert [netns.environ_of(p).get("NCCL_SOCKET_IFNAME") for p in ranks_on(node0)] == [None]
        node0.link(False)  # cut first: the dying processes' FIN/RST never reach node 1
        node0.kill()
        killed = time.monotonic()
        code1 = procs[1].wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        stop_all(procs)
        node0.link(True)
    out, out1 = tails(logs), logs[1].read_text(errors="replace")
    time.sleep(1)
    assert node1.pids() == [], [netns.cmdline_of(p) for p in node1.pids()]
    assert code1 != 0 and took < 60, (code1, took, out)
    last = [ln for ln in out1.splitlines() if ln.startswith("node 1: ")][-1]
    assert "Traceback" not in out1 and "error: node 0 (node0, " in out1 and "failed: rank 0 stopped responding" in out1
    assert last.startswith("node 1: its ranks ended with exit code ") and "node 0's launching process is gone too, " \
        "without a result.json for this attempt" in last, out1  # (was: 'node 0 says how the run ended (result.json)')


def overridden(**values: object) -> List[str]:
    """SLOW_TRAIN with these values instead of its own (Hydra refuses a key given twice)."""
    keys = {k.replace("__", "."): v for k, v in values.items()}
    return [a for a in SLOW_TRAIN if a.split("=", 1)[0] not in keys] + [f"{k}={v}" for k, v in keys.items()]


@pytest.mark.slow
def test_node_0_lost_then_both_restarted_with_more_steps(cluster, tmp_path):
    """torchrun; node 0 lost in step 2 (step 1 saved). Node 1's next `dsrecipes node` is started at once, while the
    lost attempt's one still ends its ranks: it starts nothing, it waits. Node 0 restarted (once node 1's old ranks
    are gone: node 0 refuses a run directory their lock still holds) with trainer.max_steps=7 instead of 5: node 1
    trains with that config, not the old one; both end 0 after step 7, resumed from step 1."""
    node0, node1 = cluster.nodes
    slow_step_shim(tmp_path)
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node0-again.log", tmp_path / "node1-again.log"]
    first = overridden(trainer__save_every=1)
    procs = [start_node(cluster, i, tmp_path, "torchrun", logs[i], train=first) for i in (0, 1)]
    try:
        in_step_2(tmp_path, procs, logs)
        node0.link(False)
        node0.kill()
        procs.append(start_node(cluster, 1, tmp_path, "torchrun", logs[3]))
        assert procs[1].wait(timeout=120) != 0, tails(logs)  # the lost attempt's node 1
        node0.link(True)
        assert procs[2].poll() is None and "starting its ranks" not in logs[3].read_text(errors="replace")
        assert netns.cmdline_of(procs[2].pid)[2:4] == ["dsrecipes", "node"] and len(node1.pids()) == 1
        procs.insert(2, start_node(cluster, 0, tmp_path, "torchrun", logs[2], train=overridden(trainer__max_steps=7)))
        codes = [p.wait(timeout=300) for p in procs[2:]]
    finally:
        stop_all(procs)
        node0.link(True)
    out = tails(logs)
    assert codes == [0, 0], out
    again0, again1 = logs[2].read_text(errors="replace"), logs[3].read_text(errors="replace")
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step_1'}" in again0 and "step 7/7" in again0, out
    assert "node 1: waiting for " in again1 and "node 1: its ranks finished (exit 0)" in again1, out
    lost = [ln for ln in logs[1].read_text(errors="replace").splitlines() if ln.startswith("node 1: ")][-1]
    assert "node 0's launching process is gone too" in lost, out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_7", out
    time.sleep(1)
    assert [p for n in cluster.nodes for p in n.pids()] == []


@pytest.mark.parametrize("marker, held, removed", [(False, False, False), (True, True, False), (True, False, True)])
def test_node_0s_script_removes_only_its_own_runs_idle_launch_txt(tmp_path, marker, held, removed):
    """launch/multinode_nossh.sh on node 0 removed RUN_DIR/launch.txt before anything was checked: a mistyped RUN_DIR
    lost someone else's launch.txt, a node 0 started twice the running attempt's. Now only in a dsrecipes run
    directory that no launching process holds. (`python` here only records that the script went on.)"""
    run, bin_dir = tmp_path / "run", tmp_path / "bin"
    run.mkdir()
    bin_dir.mkdir()
    (bin_dir / "python").write_text("#!/bin/sh\necho ran > \"$RUN_DIR/../ran\"\n")
    (bin_dir / "python").chmod(0o755)
    (run / LAUNCH_FILE).write_text("someone's\n")
    (run / LOCK_FILE).write_text("")
    if marker:
        (run / "dsrecipes_run.json").write_text("{}")
    lock = ExclusiveLock(run / LOCK_FILE).acquire() if held else None
    try:
        subprocess.run(["bash", str(REPO / "launch" / "multinode_nossh.sh")], check=True, timeout=30,
                       env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NODE_RANK": "0",
                            "MASTER_ADDR": "10.0.0.1", "RUN_DIR": str(run)})  # fmt: skip
    finally:
        if lock is not None:
            lock.release()
    assert (tmp_path / "ran").is_file() and (run / LAUNCH_FILE).exists() is not removed


@pytest.mark.slow
def test_node_1s_joiner_sigkilled_stops_the_run_as_node_0s_launching_process_does(cluster, tmp_path):
    """node 1's `dsrecipes node` is SIGKILLed in step 2 of 5 (`kill -9`, the OOM killer). On node 0 a SIGKILLed
    launching process makes its ranks stop at the next step boundary with a checkpoint (rank/worker.watch_launcher:
    they watch RUN/.dsrecipes.lock). Was: node 1's ranks watched nothing; measured, the run went on to step 5/5 and
    node 0 ended 0, node 1's ranks unsupervised to the end. Now `dsrecipes node` names its node lock to its ranks
    (DSRECIPES_NODE_LOCK, core/runplan.node_lock) and they watch it as node 0's watch the run's lock."""
    node0, node1 = cluster.nodes
    slow_step_shim(tmp_path)
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = [start_node(cluster, i, tmp_path, "deepspeed_multinode", logs[i]) for i in (0, 1)]
    try:
        in_step_2(tmp_path, procs, logs)
        os.kill(procs[1].pid, signal.SIGKILL)
        code0 = procs[0].wait(timeout=180)
    finally:
        stop_all(procs)
    out = tails(logs)
    time.sleep(1)
    assert [netns.cmdline_of(p) for p in node1.pids()] == [], out
    assert code0 != 0 and "step 5/5" not in out, out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_2", out


def test_a_fifo_for_a_lock_file_is_no_endless_wait(make_cfg, tmp_path, no_start, capsys):
    """Shared storage is anyone's: a FIFO where a lock file should be held the lock probe's open() for ever (no line,
    no bound). Now it is no lock: node 0's makes the wait go on to its bound (one message); node 1's own lock as a
    FIFO is refused or taken, never waited on."""
    run = tmp_path / "run"
    written_run(make_cfg, run).release()
    (run / LOCK_FILE).unlink()
    os.mkfifo(run / LOCK_FILE)
    os.utime(run / LAUNCH_FILE)
    argv = [sys.executable, "-m", "dsrecipes", "node", str(run), "--node-rank", "1", "--wait-s", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2 and "error: node 1: waited 1 s" in done.stderr and "Traceback" not in done.stderr
    assert f"(node 0's launching process holds {run / LOCK_FILE} while it runs, " in done.stderr, done.stderr
    (run / LOCK_FILE).unlink()
    lock = written_run(make_cfg, run)
    os.mkfifo(run / join.NODE_LOCK.format(1))
    codes: List[int] = []
    joined = threading.Thread(target=lambda: codes.append(node(str(run), "--node-rank", "1", "--wait-s", "2")),
                              daemon=True)
    joined.start()
    joined.join(timeout=30)
    lock.release()
    assert not joined.is_alive() and codes in ([0], [2]), capsys.readouterr().err
