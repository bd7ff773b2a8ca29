"""The end of a `dsrecipes` process (cli.entry): a stop signal that arrives after the command handled its own
interruption, while its result travels back to the process's end (seen once on a slow machine: a second Ctrl-C 1.5 s
after an interrupted pipeline's resume line killed the process by SIGINT, -2 to its parent, instead of exit 130).

The command here is a stand-in for `console_main` that has said its outcome and is still returning when the signal
comes; the process must end with the signal's exit code, no traceback, and no second message when the command had
already said it was interrupted."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env

TAIL = """
import os, signal, sys, time
import dsrecipes.cli as cli
from dsrecipes.core import stopping

signum, interrupted_before = getattr(signal, sys.argv[1]), sys.argv[2] == "said"

def returning():
    if interrupted_before:  # the command's run was interrupted and said so (stopping recorded the first signal)
        with stopping.handling():
            os.kill(os.getpid(), signal.SIGINT)
        print("the command's own message; resume with: ...", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signum)  # the next one, while the result travels back
    time.sleep(10)
    return 0

cli.console_main = returning
cli.entry()
"""


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
@pytest.mark.parametrize("before", ["said", "none"])
def test_a_stop_signal_while_the_result_travels_back_ends_with_its_exit_code(name, code, before):
    done = subprocess.run([sys.executable, "-c", TAIL, name, before], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())
    assert done.returncode == code, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == (["the command's own message; resume with: ..."] if before == "said" else ["interrupted"]), lines
    assert signal.Signals(code - 128).name == name
