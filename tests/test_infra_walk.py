"""What a user on a shared cluster does around a live run: export it while it writes, kill or stop one rank, fill
its disk, resume on another number of ranks. Each test here failed on the code before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dsrecipes.core.manifest as manifest
from dsrecipes.boundary.point_of_use import ChangedCheckpoint, CheckedCheckpoint, reading
from dsrecipes.boundary.trust import sign
from dsrecipes.core.locks import unread
from dsrecipes.rank.checkpoint import COMPLETE, prune_checkpoints
from dsrecipes.run.launch.process import _Stop, supervise
from dsrecipes.run.launch.tree import end_group


def _checkpoint(root, step):
    d = root / f"step_{step}"
    (d / "data_state").mkdir(parents=True)
    (d / "data_state" / "rank0.json").write_text(json.dumps({"step": step}))
    record = {"step": step, "world_size": 1, "files": manifest.describe(d, skip=[COMPLETE])}
    (d / COMPLETE).write_text(json.dumps(sign(record)))  # as this user's runs sign it
    return d


def test_retention_leaves_a_checkpoint_that_an_export_is_reading(tmp_path):
    """Was: `dsrecipes export RUN` beside a run saving every step failed 6 times in 6 with 'step_71/
    mp_rank_00_model_states.pt: cannot open it to load (No such file or directory)': the run's retention
    (trainer.keep_checkpoints=2) removed the checkpoint the export was reading."""
    root = tmp_path / "checkpoints"
    oldest = _checkpoint(root, 1)
    checked = CheckedCheckpoint.open(oldest)  # what export (and a resume) holds while it reads
    _checkpoint(root, 2)
    _checkpoint(root, 3)
    prune_checkpoints(root, keep=2)
    assert oldest.is_dir(), "retention removed a checkpoint that was being read"
    assert json.loads(checked.read_bytes(oldest / "data_state" / "rank0.json")) == {"step": 1}
    checked.close()
    assert prune_checkpoints(root, keep=2) == [oldest]  # the next pass removes it
    assert sorted(d.name for d in root.iterdir()) == ["step_2", "step_3"]


def test_a_checkpoint_removed_while_export_opens_it_is_named_as_such(tmp_path):
    """The export chose a checkpoint that the run's retention is removing (or removed) before the export held it:
    one message saying so, not a missing-file error from the middle of the load."""
    tag = _checkpoint(tmp_path / "run" / "checkpoints", 5)
    with unread(tag / COMPLETE) as free:  # a retention pass in progress
        assert free
        with pytest.raises(ChangedCheckpoint, match="removed while it was being opened.*keep_checkpoints"):
            with reading(tag):
                pass
        with pytest.raises(ChangedCheckpoint, match="removed while it was being opened"):
            CheckedCheckpoint.open(tag)
    with reading(tag):  # no retention pass: held
        with unread(tag / COMPLETE) as free:
            assert not free


_LAUNCHER = r"""
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write("saved")  # the rank's checkpoint at its step boundary
    os._exit(143)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".ready", "w").close()
while True:
    time.sleep(0.05)
''', sys.argv[1]])
time.sleep(600)
"""


def supervise_a_killed_launcher(tmp_path, saved) -> tuple:
    """_LAUNCHER started, SIGKILLed once its rank is ready, supervised as a run's launcher is: (supervise's code, the launcher's pid)."""
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(saved)], start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "saved.ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # the launcher only; its rank trains on
        code = supervise(proc, tmp_path, _Stop(10.0))
    finally:
        end_group(proc.pid)  # what run_subprocess does after supervise: the old code's SIGKILL of the ranks
    return code, proc.pid


def test_ranks_whose_launcher_is_killed_save_instead_of_being_killed_with_it(tmp_path, capsys):
    """Was: `kill -9` of DeepSpeed's per-node launcher (ds_node) mid-run: the launching process saw its launcher gone
    and SIGKILLed the process group, so the ranks lost every step since the last checkpoint (run: step 22 trained,
    step_20 kept) and the run said 'a rank was killed by SIGKILL (the kernel's OOM killer ...)'. Now the ranks get
    the SIGTERM of a stop (run: they saved step_32 and the run ended with its resume command, exit 143)."""
    saved = tmp_path / "saved"
    code, _ = supervise_a_killed_launcher(tmp_path, saved)
    assert code == -signal.SIGKILL
    assert saved.is_file() and saved.read_text() == "saved", "the rank was killed without saving"
    assert "was killed by SIGKILL while its ranks ran; stopping them at the next step boundary" in capsys.readouterr().err


class _Saves:
    """Stands in for a model and a tokenizer: what `save_pretrained` writes does not matter here."""

    def save_pretrained(self, path, **_):
        (Path(path) / f"{type(self).__name__}.bin").write_bytes(b"x")


def test_an_export_killed_mid_write_leaves_no_hidden_copy_in_the_run_directory(tmp_path, monkeypatch):
    """Was: rank 0 SIGKILLed while writing the run's export (a 12 M-parameter tiny model, 2 ranks) left
    RUN/.export.tmp-11215-c6ebb56a/ (a hidden, partly written model-sized directory) for good: the same command
    then exported beside it and nothing ever removed it. Now an export into a run directory (its marker
    dsrecipes_run.json) removes such staging directories of processes of this machine that are gone; a live
    process's, another name's and anything outside a run directory stay."""
    from dsrecipes.core.publish import _host
    from dsrecipes.core.rundir import MARKER_FILE
    from dsrecipes.rank import export

    monkeypatch.setattr(export, "load_deepspeed", lambda: None)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run = tmp_path / "run"
    run.mkdir()
    (run / MARKER_FILE).write_text("{}")
    stale = run / f".export.tmp-{_host()}-{gone.pid}-c6ebb56a"
    live = run / f".export.tmp-{_host()}-{os.getpid()}-0123abcd"
    other = run / ".export.tmp-mine"
    elsewhere = run / f".export.tmp-another-host-{gone.pid}-c6ebb56a"  # a machine sharing the run directory: its pid
    outside = tmp_path / f".mine.tmp-{_host()}-{gone.pid}-c6ebb56a"  # beside a directory of the user's, not a run's
    for d in (stale, live, other, elsewhere, outside):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 100)
    export._save_hf(_Saves(), _Saves(), run / "export", {"source": "test"})
    export._save_hf(_Saves(), _Saves(), tmp_path / "mine", {"source": "test"})
    assert not stale.exists()
    assert live.is_dir() and other.is_dir() and elsewhere.is_dir() and outside.is_dir()
    assert (run / "export" / "_Saves.bin").is_file() and (tmp_path / "mine" / "_Saves.bin").is_file()


def test_a_stopped_launcher_whose_ranks_ended_does_not_keep_the_run_waiting(tmp_path, monkeypatch, capsys):
    """Was: `kill -STOP` of DeepSpeed's per-node launcher (ds_node) mid-run (2 ranks, debug=fast): the ranks trained
    to the end, exported and exited (zombies of the stopped launcher), and the launching process waited for the
    launcher for ever, nothing on the console. Now a launcher still there LAUNCHER_EXIT_S after its last rank ended
    is named in one line and ended; the ranks' own outcome decides the run."""
    import threading

    from dsrecipes.run.launch import process

    monkeypatch.setattr(process, "LAUNCHER_EXIT_S", 1.0)
    launcher = ("import os, signal, subprocess, sys\n"
                "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.5)'])\n"  # a rank; never reaped
                "os.kill(os.getpid(), signal.SIGSTOP)\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    codes = []
    waiter = threading.Thread(target=lambda: codes.append(supervise(proc, tmp_path)), daemon=True)
    waiter.start()
    waiter.join(timeout=20)
    try:
        assert codes == [-signal.SIGKILL], "the launching process is still waiting for the stopped launcher"
    finally:
        end_group(proc.pid)
    err = capsys.readouterr().err
    assert f"every rank has ended, but the launcher (pid {proc.pid}, state stopped) has not exited 1 s later" in err


def test_the_evaluation_audit_of_a_run_restarted_on_fewer_ranks_leaves_out_the_retired_ranks(tmp_path):
    """Was: a 2-rank run (data=iterable, trainer.record_samples=true) with rank 1 SIGKILLed at step 10 before any
    checkpoint, started again with launcher.num_gpus=1 (it begins at step 1), failed `dsrecipes audit --ledger`: 9
    VIOLATIONs such as 'evaluation at step 0: 8 samples (rows of the validation data) scored more than once' and
    'evaluation at step 16: ... not the same set as the others': rank 1's evaluations of the replaced session were
    counted with the new world's (the training ledger already drops them). Now the evaluation ledger's session mark
    names its world size and a rank outside the world that evaluated a step is left out there."""
    from dsrecipes.data.plan.eval_ledger import EvalLedger, check_eval_ledgers

    rows = [f"row{i}" for i in range(16)]
    with EvalLedger(tmp_path, 0, 2) as r0, EvalLedger(tmp_path, 1, 2) as r1:
        for step in (0, 4, 8, 12):
            r0.record(step, rows[:8], rows[:8])
            r1.record(step, rows[8:], rows[8:])
    with EvalLedger(tmp_path, 0, 1) as r0:  # started again on one rank: it evaluates everything itself
        for step in (0, 4, 8, 12, 16):
            r0.record(step, rows, rows)
    report = check_eval_ledgers(tmp_path)
    assert report.ok, report.summary()
    assert report.steps == [0, 4, 8, 12, 16]
    with EvalLedger(tmp_path, 0, 2) as r0:  # on two ranks again: rank 0 scoring everything is still caught
        r0.record(20, rows, rows)
    with EvalLedger(tmp_path, 1, 2) as r1:
        r1.record(20, rows[8:], rows[8:])
    assert any("step 20: 8 samples (rows of the validation data) scored more than once" in p
               for p in check_eval_ledgers(tmp_path).problems)
