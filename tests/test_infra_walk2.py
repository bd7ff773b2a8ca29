"""A second walk around a live run: its launcher killed, rank 0 killed, a checkpoint tag saved again while an export
reads it. Each test here failed on the code before its fix."""

from __future__ import annotations

import json

import pytest

import dsrecipes.core.manifest as manifest
from dsrecipes.boundary.point_of_use import CheckedCheckpoint
from dsrecipes.boundary.trust import sign
from dsrecipes.commands import outcome
from dsrecipes.core import stopping
from dsrecipes.core.rank_records import write_outcome
from dsrecipes.core.rundir import CONFIG_FILE
from dsrecipes.rank.checkpoint import COMPLETE, commit, prune_checkpoints
from tests.test_infra_walk import supervise_a_killed_launcher


@pytest.fixture
def fresh_stop():
    stopping.reset()
    yield
    stopping.reset()


def test_a_run_whose_launcher_was_killed_says_so_not_interrupted_by_sigterm(tmp_path, capsys, fresh_stop):
    """Was (a44a6bd): `kill -9` of DeepSpeed's per-node launcher: the ranks were stopped with a checkpoint, but the
    run said 'interrupted by SIGTERM (latest checkpoint: ...)' on the console and in result.json, though nobody sent
    this run a SIGTERM. Now both name the launcher, its signal and the step the ranks stopped at; still `interrupted`
    with the stop's exit code (143) and the resume command."""
    saved = tmp_path / "saved"
    code, pid = supervise_a_killed_launcher(tmp_path, saved)
    assert saved.read_text() == "saved"
    # what rank 0 records when the stop's SIGTERM ends it at a step boundary (rank/train.stopped)
    write_outcome(tmp_path, {"status": "interrupted", "signal": 15, "stopped_at_step": 32, "skipped_steps": 0})
    capsys.readouterr()
    assert outcome.conclude(tmp_path, code, False, ["debug=fast"]) == (143, True)
    err = capsys.readouterr().err
    result = json.loads((tmp_path / "result.json").read_text())
    named = f"the launcher (pid {pid}, "
    assert "SIGTERM" not in err and "SIGTERM" not in result["error"], (err, result["error"])
    assert named in err and "was killed by SIGKILL while its ranks ran; they were stopped at step 32" in err, err
    assert "Resume with:" in err and "trainer.resume" not in result["resume_command"].split("&&")[0]
    assert result["status"] == "interrupted" and result["exit_code"] == 143
    assert result["error"].startswith(named) and result["error"].endswith("they were stopped at step 32")


def _files(d, step):
    (d / "data_state").mkdir(parents=True)
    (d / "data_state" / "rank0.json").write_text(json.dumps({"step": step, "version": str(d)}))
    return d


def test_saving_a_tag_again_keeps_the_old_version_an_export_is_reading(tmp_path, capsys):
    """Was: commit() of a tag saved again (after a resume from an earlier step, step_5 is written anew) removed the
    old step_5 at once, though a `dsrecipes export` of it held the shared read lock (85b0b98) that retention
    respects: the export's next file was gone. Now the old version is removed only under the exclusive lock; while
    it is read it is kept as step_5.replaced (one line says so, nothing waits) and a later retention pass removes
    it once the reader is done."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    run.mkdir()
    (run / CONFIG_FILE).write_text("trainer: {}\n")
    old = _files(root / "step_5", 5)
    record = {"step": 5, "world_size": 1, "files": manifest.describe(old, skip=[COMPLETE])}
    (old / COMPLETE).write_text(json.dumps(sign(record)))
    checked = CheckedCheckpoint.open(old)  # what an export of step_5 holds while it reads
    staging = _files(root / "step_5.partial", 5)
    commit(run, staging, root / "step_5", {"step": 5, "world_size": 1})
    assert json.loads((root / "step_5" / "data_state" / "rank0.json").read_text())["version"].endswith(".partial")
    state = json.loads(checked.read_bytes(old / "data_state" / "rank0.json"))  # the old version, through its fds
    assert state == {"step": 5, "version": str(old)}, "the re-save removed the version an export was reading"
    err = capsys.readouterr().err
    assert "step_5: the version this save replaced is being read by" in err and "kept as step_5.replaced" in err
    assert prune_checkpoints(root, keep=2) == []  # still read: retention leaves it too
    checked.close()
    assert prune_checkpoints(root, keep=2) == [root / "step_5.replaced"]
    assert sorted(d.name for d in root.iterdir()) == ["latest", "step_5"]


def test_saving_a_tag_again_removes_the_old_version_nobody_reads(tmp_path, capsys):
    run = tmp_path / "run"
    root = run / "checkpoints"
    run.mkdir()
    (run / CONFIG_FILE).write_text("trainer: {}\n")
    old = _files(root / "step_5", 5)
    (old / COMPLETE).write_text(json.dumps(sign({"step": 5, "world_size": 1, "files": {}})))
    commit(run, _files(root / "step_5.partial", 5), root / "step_5", {"step": 5, "world_size": 1})
    assert sorted(d.name for d in root.iterdir()) == ["latest", "step_5"] and not capsys.readouterr().err


class _Store:
    """The job's store as rank 1 sees it: rank 0 serves it, so it answers until rank 0 is killed."""

    def __init__(self, who0):
        self.data, self.up = {"dsrecipes/heartbeat/0/who/0": json.dumps(who0).encode()}, True

    def _answer(self):
        if not self.up:
            raise RuntimeError("Connection reset by peer")  # torch's DistNetworkError once rank 0 is gone

    def set(self, key, value):
        self._answer()
        self.data[key] = value

    def add(self, key, n):
        self._answer()
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]

    def check(self, keys):
        self._answer()
        return all(k in self.data for k in keys)

    def get(self, key):
        self._answer()
        return self.data[key]


def test_a_killed_rank_0_is_named_with_its_place(tmp_path, monkeypatch, capsys, fresh_stop):
    """Was: SIGKILL of rank 0 in a 2-rank run (recipe=cpu_zero2_two_ranks debug=fast) said 'error: a rank was killed
    by SIGKILL ...' while a killed rank 1 is named: rank 0 serves the job's store, so rank 1's heartbeat saw only
    'the job's store ... stopped answering' and failure.json listed no lost rank. Now, where rank 0 serves the
    store (not torchrun's agent), a store gone silent is rank 0 lost, named with what rank 1 learned of it while it
    was up: its host, local rank and pid."""
    import dsrecipes.core.heartbeat as heartbeat
    import dsrecipes.core.stall as stall

    def exit_thread(code):
        raise SystemExit(code)

    monkeypatch.setenv("LOCAL_RANK", "1")  # rank 1 on the same node: it reads no other rank's counter
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.02)
    monkeypatch.setattr(heartbeat.os, "_exit", exit_thread)
    who0 = {"rank": 0, "node": 0, "host": "node-a", "addr": "10.0.0.1", "pid": 4242, "local_rank": "0"}
    beat = heartbeat.Heartbeat(tmp_path, 1, 2, 30, stall.Watch(0, 0))
    beat.store = _Store(who0)
    ended = []
    original = beat._beat

    def beat_then_lose_rank_0():
        if beat.count >= 3:
            beat.store.up = False  # rank 0 SIGKILLed: its store goes with it
        return original()

    beat._beat = beat_then_lose_rank_0
    try:
        beat._beating()
    except SystemExit as exc:
        ended.append(exc.code)
    assert ended == [heartbeat.PEER_LOST_EXIT]
    record = json.loads((tmp_path / "failure.json").read_text())
    assert [w["rank"] for w in record["lost"]] == [0], record
    capsys.readouterr()
    assert outcome.conclude(tmp_path, 247, False, ["debug=fast"]) == (1, False)  # DeepSpeed's launcher: 247
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: rank 0 was killed by SIGKILL (the kernel's OOM killer"), err
    assert "rank 0 ran on host node-a (local rank 0, pid 4242); the other ranks were stopped" in err, err
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"].startswith("rank 0 was killed by SIGKILL") and "pid 4242" in result["error"]
