"""A second Ctrl-C (more than a second after the first was acknowledged: stop at once) under a launcher that runs
its ranks as child processes: the run says how it stopped once, with the latest checkpoint and the resume command,
and exits 130. Was (found by a review under launcher=torchrun and launcher=deepspeed): commands/train.py reported
the interruption and re-raised it, and cli.run_guarded printed a bare 'interrupted' after it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO, subprocess_env
from tests.helpers.pipeline_runs import kill_group
from tests.test_review_launch_tree import SLOW_STEP

pytestmark = pytest.mark.slow


def test_a_second_ctrl_c_is_said_once_with_the_resume_command(tmp_path):
    out, log, mark, shim = tmp_path / "run", tmp_path / "console.log", tmp_path / "slow.mark", tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SLOW_STEP, encoding="utf-8")  # rank 0: 20 s past step 1
    env = {"PYTHONPATH": f"{shim}:{REPO}", "SLOW_MARK": str(mark), "SLOW_S": "20"}
    argv = [sys.executable, "-m", "dsrecipes", "train", "debug=fast", "launcher=deepspeed", "launcher.num_gpus=1",
            "trainer.max_steps=3", "trainer.save_every=1", "trainer.eval_every=0", f"trainer.output_dir={out}"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=subprocess_env(env), start_new_session=True, stdout=fh,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while not mark.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            pytest.fail(log.read_text()[-3000:])
        time.sleep(0.05)
    family = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGINT)
    while "stopping at the next step boundary" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(1.5)  # past stopping.SAME_INTERRUPTION_S: a second Ctrl-C of its own, which stops at once
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail(log.read_text()[-3000:])
    text = log.read_text(errors="replace")
    assert code == 130, text[-3000:]
    lines = text.splitlines()
    assert "interrupted" not in lines, text[-3000:]  # the bare line, after the real one
    assert sum("resume with" in line.lower() for line in lines) == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
