"""Two ranks print into the one pipe their launcher shares (torchrun, DeepSpeed's launch.py) under PYTHONUNBUFFERED
(run/launch/process._start sets it for a relayed launcher): `print` wrote its text and its newline in two writes, so
another rank's line could land between them; seen in CI as '... in float32dsrecipes: rank 0: ...'. A rank's console
(core/console.survive_lost_console) is line-buffered now: every line arrives whole."""

from __future__ import annotations

import os
import re
import subprocess
import sys

RANK = r"""
import sys
from pathlib import Path
from dsrecipes.core.console import survive_lost_console
if sys.argv[2] == "fixed":
    survive_lost_console(Path(sys.argv[3]))
for n in range(3000):
    print(f"dsrecipes: rank {sys.argv[1]}: line {n} of a message long enough to be written in pieces", file=sys.stderr)
"""


def _lines(tmp_path, mode: str) -> list:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), mode, str(tmp_path / f"rank{r}.log")], env=env,
                              stderr=write) for r in (0, 1)]
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    assert [p.wait(60) for p in procs] == [0, 0]
    return text.splitlines()


def test_two_ranks_lines_arrive_whole(tmp_path):
    lines = _lines(tmp_path, "fixed")
    whole = re.compile(r"dsrecipes: rank [01]: line \d+ of a message long enough to be written in pieces")
    broken = [line for line in lines if not whole.fullmatch(line)]
    assert len(lines) == 6000 and not broken, (len(lines), broken[:3])
