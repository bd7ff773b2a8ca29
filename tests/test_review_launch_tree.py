"""run/launch/tree.py and process.py under launcher=torchrun, as a sceptic tests them: torchrun starts each rank in a
session of its own, and a SIGKILLed torchrun agent leaves them orphaned.

- The real command, 2 ranks with 2 DataLoader workers each, rank 0 in a long step, no checkpoint yet: its torchrun
  agent SIGKILLed (taking the job's store with it). Exit 143, the launcher named once, no traceback, the step saved,
  not one rank or worker left, and the same command resumes to the weights and losses of an uninterrupted run.
- A stop signal reaches a rank outside the launcher's group once: from the live launcher alone (a second SIGINT
  from here too would stop the ranks at once), from here once the launcher has ended.
- torchrun SIGKILLs its ranks 30 s after it passed a stop signal on (its --shutdown_timeout): the launcher is told to
  wait past trainer.stop_grace_s (a step and checkpoint of 36 s were killed at 30 s, nothing saved, nothing said).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import psutil
import pytest

import dsrecipes.run.launch.process as process
from dsrecipes.run.launch import build_plan
from dsrecipes.run.launch.plan import TORCHRUN_SHUTDOWN, Command
from dsrecipes.run.launch.tree import Tree
from tests.conftest import REPO, subprocess_env
from tests.helpers.pipeline_runs import kill_group

pytestmark = pytest.mark.slow

TINY = ["debug=fast", "launcher=torchrun", "launcher.num_gpus=2", "data.num_workers=2", "trainer.max_steps=3",
        "trainer.eval_every=0", "trainer.log_every=1"]

# rank 0 spends SLOW_S s past the end of step 1 (a long step): in every process started with this on PYTHONPATH
SLOW_STEP = '''import os, sys, time, importlib.abc, importlib.util
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "dsrecipes.rank.train":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(train):
            run(train)
            after_step = train.after_step
            def slow(s):
                after_step(s)
                if s.rank == 0 and s.state.step == 1:
                    open(os.environ["SLOW_MARK"], "w").close()
                    time.sleep(float(os.environ["SLOW_S"]))
            train.after_step = slow
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Finder())
'''


def _start(tmp_path: Path, out: Path, env: Dict[str, str], *extra: str, log: str = "first.log") -> subprocess.Popen:
    argv = [sys.executable, "-m", "dsrecipes", "train", *TINY, f"trainer.output_dir={out}", *extra]
    with open(tmp_path / log, "wb") as fh:
        return subprocess.Popen(argv, cwd=tmp_path, env=subprocess_env(env), start_new_session=True, stdout=fh,
                                stderr=subprocess.STDOUT)


def _held(proc: subprocess.Popen, marker: Path, log: Path) -> List[psutil.Process]:
    """Once `marker` exists: every process the run started (the launcher, the ranks, their DataLoader workers)."""
    deadline = time.monotonic() + 60
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            pytest.fail(f"{marker} never appeared (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    time.sleep(0.8)  # the launching process looks at the launcher's tree every 0.5 s
    return psutil.Process(proc.pid).children(recursive=True)


def _ended(proc: subprocess.Popen, log: Path, family: List[psutil.Process], within: float = 30) -> Tuple[int, str]:
    try:
        code = proc.wait(within)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail(f"still running {within:.0f} s later:\n{log.read_text()[-3000:]}")
    _, alive = psutil.wait_procs(family, timeout=5)
    for p in alive:
        p.kill()
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    return code, log.read_text(errors="replace")


def _agent_and_ranks(family: List[psutil.Process]) -> Tuple[psutil.Process, List[psutil.Process], List[psutil.Process]]:
    agents = [p for p in family if "torch.distributed.run" in p.cmdline()]
    workers = [p for p in family if "dsrecipes.rank.worker" in p.cmdline()]
    ranks = [p for p in workers if p.ppid() == agents[0].pid]
    loaders = [p for p in workers if p.ppid() in {r.pid for r in ranks}]
    assert len(agents) == 1 and len(ranks) == 2 and len(loaders) == 4, [p.cmdline()[:4] for p in family]
    assert all(os.getpgid(r.pid) == r.pid for r in ranks)  # torchrun's ranks lead sessions of their own
    return agents[0], ranks, loaders


def _losses(run_dir: Path) -> Dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _digest(run_dir: Path) -> str:
    return hashlib.sha256((run_dir / "export" / "model.safetensors").read_bytes()).hexdigest()


def test_a_sigkilled_torchrun_agent_mid_step_stops_both_ranks_with_that_step_saved_and_the_run_resumes_exactly(
        tmp_path):
    """The agent is SIGKILLed while rank 0 is in a long step (3 s past step 1), no checkpoint taken yet
    (save_every=100), the heartbeat on: the agent took the job's store with it, which each rank's heartbeat took for a
    lost peer and ended its rank within a second (exit 75, every step lost: core/heartbeat._store_lost). Now the
    ranks stop at the next step boundary with a checkpoint, nothing of them is left, and the same command resumes
    from that checkpoint to the losses and weights of an uninterrupted run."""
    shim = tmp_path / "slow"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SLOW_STEP, encoding="utf-8")
    out, mark, same = tmp_path / "run", tmp_path / "slow.mark", ("trainer.save_every=100",)
    env = {"PYTHONPATH": f"{shim}{os.pathsep}{REPO}", "SLOW_MARK": str(mark), "SLOW_S": "3"}
    proc = _start(tmp_path, out, env, *same)
    family = _held(proc, mark, tmp_path / "first.log")
    agent, ranks, loaders = _agent_and_ranks(family)
    agent.kill()
    killed_at = time.monotonic()
    code, text = _ended(proc, tmp_path / "first.log", family)
    took = time.monotonic() - killed_at
    named = f"the launcher (pid {agent.pid}, torch.distributed.run) was killed by SIGKILL while its ranks ran"
    assert code == 143 and f"{named}; stopping them at the next step boundary" in text, text[-3000:]
    assert text.count(f"{named}; they were stopped") == 1 and "resume with:" in text.lower(), text[-3000:]
    assert "Traceback" not in text and "a rank was killed" not in text and "error:" not in text, text[-3000:]
    assert "stopped responding" not in text and "stopped answering" not in text, text[-3000:]
    assert took < 15, took  # the rest of rank 0's 3 s step, then the checkpoint
    stopped = re.search(r"they were stopped at step (\d+) \(latest checkpoint: (.*)/step_(\d+)\)", text)
    assert stopped and stopped[1] == stopped[3] == "2" and (out / "checkpoints" / "step_2").is_dir(), text[-3000:]

    again = _start(tmp_path, out, {}, *same, log="again.log")  # the same command: resumes from there
    code, text = _ended(again, tmp_path / "again.log", [], within=120)
    assert code == 0 and "resumed at step 2)" in text, text[-3000:]
    reference = _start(tmp_path, tmp_path / "reference", {}, *same, log="reference.log")
    code, text = _ended(reference, tmp_path / "reference.log", [], within=120)
    assert code == 0, text[-3000:]
    assert _losses(out) == _losses(tmp_path / "reference") and len(_losses(out)) == 3
    assert _digest(out) == _digest(tmp_path / "reference")


# A launcher that starts a rank in a session of its own (as torchrun does) and passes a stop signal on to it, as
# torchrun does; the rank counts the SIGINTs it gets (argv[1]: the count's file).
_LAUNCHER = r"""
import signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
got = []
def note(*_):
    got.append(1)
    open(sys.argv[1], "w").write(str(len(got)))
signal.signal(signal.SIGINT, note)
signal.signal(signal.SIGTERM, note)
open(sys.argv[1], "w").write("0")
for _ in range(1200):  # 60 s at most: a failed test leaves nothing running for long
    time.sleep(0.05)
''', sys.argv[1]], start_new_session=True)
signal.signal(signal.SIGINT, lambda *_: rank.send_signal(signal.SIGINT))
for _ in range(1200):
    time.sleep(0.05)
"""


def _count(path: Path, want: Optional[str] = None) -> str:
    deadline = time.monotonic() + 10
    while not path.exists() or (want is not None and path.read_text() != want and time.monotonic() < deadline):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return path.read_text()


def test_a_stop_signal_reaches_a_rank_outside_the_group_once_from_the_launcher_while_it_lives(tmp_path):
    counted = tmp_path / "count"
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(counted)], start_new_session=True)
    try:
        _count(counted, "0")
        tree = Tree(launcher.pid)
        (rank,) = tree.look()
        tree.signal(signal.SIGINT)  # the launcher passes it on: one SIGINT, not two (a second stops at once)
        assert _count(counted, "1") == "1"
        time.sleep(0.5)
        assert counted.read_text() == "1"
        launcher.kill()
        launcher.wait()
        tree.signal(signal.SIGINT)  # the launcher is gone: from here, to the rank it left
        assert _count(counted, "2") == "2"
        tree.end()
        assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_torchrun_is_told_to_wait_past_the_grace_before_it_kills_its_ranks(tmp_path, monkeypatch, make_cfg):
    """The launcher started for the torchrun plan's command (launch.txt's line, which every node runs) is given
    TORCHRUN_SHUTDOWN past trainer.stop_grace_s by that command alone; the user's own value (exported) stands, and a
    command built elsewhere is given nothing (run_subprocess added it too, e52882f's backstop; one place now)."""
    seen = tmp_path / "seen"
    show = [sys.executable, "-c", f"import os; open({str(seen)!r}, 'w').write(os.environ.get({TORCHRUN_SHUTDOWN!r}, "
                                  "'unset'))"]  # fmt: skip

    def launched(*overrides: str) -> str:
        cfg = make_cfg("launcher=torchrun", *overrides, check_files=False)
        (cmd,) = build_plan(cfg, tmp_path, master_port=29500).commands
        ran = process.run_subprocess(dataclasses.replace(cmd, argv=show), tmp_path, cfg.trainer.stop_grace_s)
        assert ran == 0
        return seen.read_text()

    monkeypatch.delenv(TORCHRUN_SHUTDOWN, raising=False)
    assert launched() == "70"  # torchrun's own default: 30 s, half of trainer.stop_grace_s's
    assert launched("trainer.stop_grace_s=2.5") == "13"
    assert process.run_subprocess(Command(show), tmp_path, grace_s=60) == 0 and seen.read_text() == "unset"
    monkeypatch.setenv(TORCHRUN_SHUTDOWN, "7")  # exported: stands too
    assert launched() == "7"


# A launcher that is SIGKILLed (here: by itself) as soon as its rank, in a session of its own, is up: before the
# launching process's first look at its tree. The rank saves and exits 143 on SIGTERM (argv[1]: where).
_KILLED_AT_ONCE = r"""
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write("saved")
    os._exit(143)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(30)
''', sys.argv[1]], start_new_session=True)
while not os.path.exists(sys.argv[1] + ".ready"):
    time.sleep(0.005)
open(sys.argv[1] + ".rank", "w").write(str(rank.pid))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_started_just_before_its_launcher_was_killed_is_found_by_the_launchers_mark(tmp_path, capsys):
    """Was: a rank started less than one poll (0.5 s) before its torchrun was killed was not followed: the run ended
    at once, reported as 'a rank was killed by SIGKILL (the kernel's OOM killer ...)', the rank left running."""
    saved = tmp_path / "saved"
    code = process.run_subprocess(Command([sys.executable, "-c", _KILLED_AT_ONCE, str(saved)]), tmp_path, grace_s=10)
    err = capsys.readouterr().err
    rank = int((tmp_path / "saved.rank").read_text())
    alive = psutil.pid_exists(rank) and psutil.Process(rank).status() != psutil.STATUS_ZOMBIE
    if alive:
        psutil.Process(rank).kill()
    assert not alive and code == -signal.SIGKILL, err
    assert "was killed by SIGKILL while its ranks ran; stopping them at the next step boundary" in err, err
    assert saved.read_text() == "saved"


def test_a_process_left_is_named_by_what_it_runs_not_by_its_thread_name():
    """'waiting 30 s for pid 3190 (pt_elastic) to save and stop' was torchrun's agent: psutil's name is the one its
    main thread took; the message now says torch.distributed.run."""
    from dsrecipes.run.launch.tree import command_name

    assert command_name([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]) == \
        "torch.distributed.run"
    assert command_name("/usr/bin/mpirun -np 2") == "mpirun" and command_name([]) == ""
