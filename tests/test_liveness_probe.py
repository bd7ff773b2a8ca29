"""`trainer.micro_batch_size=auto`: a probe that overruns PROBE_TIMEOUT_S is killed with everything it started (a JIT
build's compilers: here a grandchild that sleeps), and the run ends with the probe's one message. Before,
subprocess.run's timeout killed the probe process alone and its children lived on after the launching process."""

from __future__ import annotations

import dataclasses
import sys
import time

import psutil
import pytest

from dsrecipes.core.errors import UserError
from dsrecipes.core.schema import TrainConfig
from dsrecipes.run import micro_batch

PROBE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(60)
"""


def test_a_probe_past_its_bound_goes_with_what_it_started(tmp_path, monkeypatch):
    pid_file = tmp_path / "grandchild.pid"
    monkeypatch.setattr(micro_batch, "PROBE_TIMEOUT_S", 3)
    monkeypatch.setattr(micro_batch, "_probe_argv", lambda: [sys.executable, "-c", PROBE, str(pid_file)],
                        raising=False)
    if not hasattr(micro_batch, "_run_alone"):  # the old code ran the module by name: run the fake probe instead
        real = micro_batch.subprocess.run
        monkeypatch.setattr(micro_batch.subprocess, "run",
                            lambda argv, **kw: real([sys.executable, "-c", PROBE, str(pid_file)], **kw))
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_size="auto"))
    started = time.monotonic()
    with pytest.raises(UserError, match="the probe did not finish within 3 s"):
        micro_batch.run_probe(cfg)
    assert time.monotonic() - started < 7
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and psutil.pid_exists(grandchild) and \
            psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    alive = psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE
    if alive:
        psutil.Process(grandchild).kill()
    assert not alive, "the probe's child outlived the probe"
