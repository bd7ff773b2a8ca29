"""A data=iterable file replaced by a FIFO while the run reads it: a DataLoader worker that opens it afterwards (the
next epoch's fresh workers) must get one DataError naming the file, not block in open() until the stall watchdog
(launcher.stall_timeout_s, 30 minutes by default) ends the run without naming it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.data.stream.index import BlockSource, build_stream_index
from tests.test_stream import write_corpus


def test_a_data_file_replaced_by_a_fifo_is_named_not_waited_on(make_cfg, tmp_path: Path):
    paths = write_corpus(tmp_path, [200])
    cfg = make_cfg("data=iterable", f"dataset.paths=[{paths[0]}]", f"data.cache_dir={tmp_path / 'c'}", "dataset.val_size=4")
    index = build_stream_index(cfg)
    os.unlink(paths[0])
    os.mkfifo(paths[0])
    outcome: list = []

    def read() -> None:
        try:
            BlockSource(index).block(0)
        except DataError as exc:
            outcome.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=2)
    if reader.is_alive():  # release the blocked open() so the thread ends
        os.close(os.open(paths[0], os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the reader blocked opening a FIFO where the indexed data file was")
    assert outcome and "part0.jsonl" in outcome[0] and "changed since the launching process indexed it" in outcome[0]
