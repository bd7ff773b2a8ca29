"""A rank stopped by SIGTERM/Ctrl-C (RunInterrupted, after its checkpoint) exits at once even while something still
holds its DataLoader iterator: its workers ignore SIGTERM (base.worker_ignores_stop_signals), so multiprocessing's
exit handler, which terminates daemonic children with SIGTERM and joins them, would wait forever. Seen in the full
suite as a flaky `map-w2-r1-launcher_killed` fault-matrix resume: the second session wrote result.json and its resume
line, then never exited. The same holds for a rank that trained to the end with a loader left mid-epoch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import subprocess_env

CHILD = textwrap.dedent("""
    import sys
    import torch
    from torch.utils.data import DataLoader
    from dsrecipes.core.errors import RunInterrupted
    from dsrecipes.data.strategies import base
    from dsrecipes.rank import worker

    KEEP = []

    def run(run_dir):
        loader = DataLoader(list(range(64)), batch_size=2, num_workers=2,
                            worker_init_fn=base.worker_ignores_stop_signals)
        it = base.iterate(loader)
        next(it)
        KEEP.append(it)  # a reference that outlives the loop (a traceback, a session object, ...)
        if sys.argv[1] == "interrupted":
            raise RunInterrupted(15, 3)

    worker.run = run
    print("exit", worker.run_rank(sys.argv[2]), flush=True)
""")


@pytest.mark.parametrize("how", ["interrupted", "finished"])
def test_the_rank_exits_with_its_workers_gone(how, tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, how, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("exit 143" if how == "interrupted" else "exit 0"), done.stdout
