"""Red team, liveness: a run whose disk fills up mid-run (another process filled it) and a lone rank's failure.

Tried for real (launcher=local, debug=fast, output_dir on a 40 MiB tmpfs filled by `dd` at step 10): the rank's
metrics write failed (ENOSPC), then 7 s of silence (heartbeat.explain_crash looking for peers a lone rank does not
have), then a traceback of the launching process from result.json's write, a 0-byte `.failure.json.<pid>.tmp` left
in the run directory, and the cause (metrics.py's OSError) never said: failure.json could not be written, so nobody
printed it.
"""

from __future__ import annotations

import errno
import signal
import time
from pathlib import Path

import pytest

import dsrecipes.core.failure as failure
import dsrecipes.core.rundir as rundir


def _full_disk(monkeypatch):
    """Path.write_text that creates its file, then fails as a full disk does."""
    def write_text(self, *args, **kwargs):
        self.touch()
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", write_text)


def test_a_failure_report_on_a_full_disk_leaves_nothing_and_is_said_by_the_rank(tmp_path, monkeypatch):
    _full_disk(monkeypatch)
    report = failure.record_rank_failure(tmp_path, 0, OSError(errno.ENOSPC, "No space left on device"), None)
    assert list(tmp_path.iterdir()) == []  # before: a 0-byte .failure.json.<pid>.tmp
    assert "No space left on device" in report["unrecorded"]  # rank/worker.failed prints it (nobody else can)


def test_result_json_on_a_full_disk_is_a_warning_not_a_traceback(tmp_path, monkeypatch, capsys):
    def atomic_write_json(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(rundir, "atomic_write_json", atomic_write_json)
    rundir.write_result(tmp_path, 1, "rank 0 failed: OSError")  # before: the OSError went up to the console
    assert f"{tmp_path / 'result.json'} not written: No space left on device" in capsys.readouterr().err


@pytest.fixture
def lone(tmp_path, monkeypatch):
    from tests.test_liveness_heartbeat import beating

    with beating(tmp_path, monkeypatch, 1) as hb:
        yield hb


def test_a_lone_ranks_failure_does_not_look_for_peers(lone):
    started = time.monotonic()
    lone.explain_crash()  # before: the whole look, 0.5 + 3 x 0.1 s here (7 s in a run) after every failure
    assert time.monotonic() - started < 0.3


@pytest.mark.parametrize("rank, lines", [("0", 1), ("1", 0)])
def test_a_non_finite_loss_is_said_once_not_by_every_rank(rank, lines, tmp_path, monkeypatch, capsys):
    """Tried for real (2 ranks, tests/faults.py nan_at_step=12): the same 'error: non-finite loss ...' line twice,
    one per rank (64 on 64 ranks). Every rank meets TrainingFailed together (an all-reduced verdict)."""
    import dsrecipes.rank.worker as worker
    from dsrecipes.core.errors import TrainingFailed

    def run(run_dir):
        raise TrainingFailed("non-finite loss (NaN/Inf) at step 12", 12)
    monkeypatch.setattr(worker, "run", run)
    monkeypatch.setattr(worker, "end_workers", lambda: None)
    monkeypatch.setenv("RANK", rank)
    assert worker.run_rank(tmp_path) == 1
    assert capsys.readouterr().err.count("error: non-finite loss") == lines


HANG_UP = """
import os, signal, sys
import dsrecipes.core.stopping as stopping
seen = []
with stopping.handling(on_signal=seen.append):
    os.kill(os.getpid(), signal.SIGHUP)
print(stopping.requested(), seen)
try:
    with stopping.raising():
        os.kill(os.getpid(), signal.SIGHUP)
except KeyboardInterrupt as exc:
    print(stopping.signal_of(exc))
"""


def test_a_hang_up_stops_the_run_as_sigterm_does():
    """Tried for real (2 ranks, SIGHUP to the launching process, as when the ssh session that started it closes):
    the launching process died at once, no result.json, no resume command (its ranks saw it gone and saved). Now
    SIGHUP is SIGTERM: recorded, forwarded as SIGTERM (DataLoader workers ignore SIGTERM, not SIGHUP), exit 143."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", HANG_UP], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done  # before: -1, killed by the SIGHUP
    assert done.stdout.split("\n")[:2] == [f"{int(signal.SIGTERM)} [<Signals.SIGTERM: 15>]", "15"], done.stdout


def test_a_hang_up_under_nohup_stays_ignored():
    """`nohup dsrecipes ...` asks the run to outlive its terminal: SIGHUP is ignored when it starts. Before, handling()
    and raising() installed their handler over that, so closing the terminal stopped a nohup'd run."""
    import subprocess
    import sys

    script = "import signal\nsignal.signal(signal.SIGHUP, signal.SIG_IGN)\n" + HANG_UP + (
        "print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done
    assert done.stdout.split("\n")[:2] == ["None []", "True"], done.stdout  # nothing recorded, still ignored
