"""Red team, liveness (second round): a full disk under TensorBoard's event files, a pipeline stopped during a stage,
and `dsrecipes score` on a directory that is not a verified export.

Tried for real (launcher=local, debug=fast, report_to tensorboard, output_dir on a 40 MiB tmpfs filled by `dd` at
step 10): TensorBoard's writer thread printed its own 15-line traceback ('Exception in thread Thread-1: ...
OSError: [Errno 28] No space left on device'), then 'warning: tensorboard: log_metrics failed', and the run went on
until metrics.jsonl's write failed; with report_to=[] only that last failure was said.
"""

from __future__ import annotations

import errno
import threading
import time

import pytest

from dsrecipes.observe import trackers


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_under_tensorboard_stops_the_run_without_the_threads_traceback(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)  # what the thread would print on the console
    tracker = trackers.TensorBoardTracker(tmp_path, 0)
    monkeypatch.setattr(record_writer.RecordWriter, "write", _no_space)  # the disk fills up mid-run
    alive = trackers.call_each([tracker], "log_metrics", {"train/loss": 1.0}, 1)
    deadline = time.monotonic() + 5
    while tracker.writer.file_writer.event_writer._async_writer._worker.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError) as raised:  # before: a warning, and the run went on writing to the full disk
        trackers.call_each(alive, "log_metrics", {"train/loss": 1.0}, 2)
    assert raised.value.errno == errno.ENOSPC
    assert printed == []  # before: the writer thread's traceback
    assert trackers.call_each([tracker], "close", False, stop_on_full=False) == []  # a failing run keeps its error
