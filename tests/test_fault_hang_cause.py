"""A failing rank's `end_workers` returns even when a DataLoader worker died holding a lock it shares with its rank.

torch's DataLoader shares a multiprocessing Event (`_workers_done_event`) with its workers; a worker takes the event's
lock for a moment each time it checks it (`Event.is_set`, on every index it receives). A worker SIGKILLed inside that
moment leaves the lock held forever, and `Event.set` - the first thing torch's `_shutdown_workers` does - then waits
for it forever. `base.end_workers` SIGKILLs the workers first and called `_shutdown_workers` after: a rank failing
right after handing a worker its next index (torch does so just before it re-raises a worker's DataError) hung with
no line and no result.json (seen once in CI: test_fault_matrix's iterable-w2-r1-file_changed, no line after step 10).

The scenario is built exactly: worker 1 takes the event's lock (found in torch's `_worker_loop` frame) and stays in
it; the rank then ends its workers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCENARIO = textwrap.dedent('''
    import inspect, os, sys, time
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from dsrecipes.data.strategies import base

    held, go = sys.argv[1], sys.argv[2]

    class Holder(IterableDataset):
        def __iter__(self):
            if torch.utils.data.get_worker_info().id == 1:
                while not os.path.exists(go):
                    time.sleep(0.02)
                frame = inspect.currentframe()
                while frame is not None and frame.f_code.co_name != "_worker_loop":
                    frame = frame.f_back
                frame.f_locals["done_event"]._cond.acquire()  # what Event.is_set() holds for a moment
                open(held, "w").close()
                while True:
                    time.sleep(1)
            yield from (torch.tensor([i]) for i in range(10_000))

    loader = DataLoader(Holder(), batch_size=None, num_workers=2, worker_init_fn=base.worker_ignores_stop_signals)
    batches = base.iterate(loader)
    next(batches)  # from worker 0
    open(go, "w").close()
    deadline = time.monotonic() + 8
    while not os.path.exists(held):
        if time.monotonic() > deadline:
            sys.exit("worker 1 never took the done event's lock (torch's _worker_loop changed?)")
        time.sleep(0.02)
    started = time.monotonic()
    base.end_workers()  # SIGKILLs worker 1 while it holds the lock
    print(f"ended in {time.monotonic() - started:.1f} s", flush=True)
    os._exit(0)
''')


def test_end_workers_returns_when_a_worker_died_holding_the_done_event_lock(tmp_path):
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    try:
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "held"), str(tmp_path / "go")], cwd=REPO,
                              capture_output=True, text=True, timeout=12)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"end_workers did not return (waits for the lock of a dead worker): {exc.stdout!r}") \
            from None
    assert done.returncode == 0 and "ended in" in done.stdout, (done.returncode, done.stdout, done.stderr[-2000:])
    assert float(done.stdout.split()[2]) < 6, done.stdout  # end_workers' own bound is 5 s
