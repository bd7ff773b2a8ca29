"""The fault-injection harness of tests/test_fault_matrix.py and scripts/fault_matrix.py (issue 43): a real
`python -m dsrecipes` run in a session of its own, a fault injected once it has trained past its first checkpoint,
then what a sceptical user would check: it ended by itself within its bound, failed with the cause named, printed
no traceback, left no process of its session, and its previous checkpoint still verifies.

Faults (injected at step INJECT_AT, after the checkpoint at step 2):
  file_changed     the data grows under the run (iterable: the corpus; presharded: the parts; map: the prepared cache)
  worker_killed    one DataLoader worker of the last rank gets SIGKILL (what the OOM killer sends)
  rank_killed      the last rank gets SIGKILL (a segfault, the OOM killer on the rank itself)
  rank_stopped     the last rank gets SIGSTOP (stuck in a driver call): the heartbeat notices (world 2 only)
  launcher_killed  the launching process gets SIGKILL: no rank or worker may outlive it
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
INJECT_AT = 3  # the step after which the fault is injected (a checkpoint exists at step 2)
PEER_TIMEOUT_S = 8
FAULTS = ("file_changed", "worker_killed", "rank_killed", "rank_stopped", "launcher_killed")


@dataclass(frozen=True)
class Case:
    strategy: str  # map | iterable | presharded
    workers: int
    world: int
    fault: str

    @property
    def name(self) -> str:
        return f"{self.strategy}-w{self.workers}-r{self.world}-{self.fault}"

    @property
    def bound_s(self) -> float:
        """Seconds from the fault to the end of every process of the run."""
        return PEER_TIMEOUT_S + 30 if self.fault == "rank_stopped" else 30

    def applies(self) -> bool:
        if self.fault == "worker_killed" and self.workers == 0:
            return False
        if self.fault in ("rank_stopped", "rank_killed") and self.world == 1:  # launcher=local: the rank is the
            return False  # launching process (launcher_killed), and a lone rank has no peer to notice it stop
        return True


@dataclass
class Outcome:
    case: Case
    seconds: float  # from the fault to the end of the last process of the run (inf: still there at the bound)
    code: Optional[int]
    console: str
    result: Dict
    left: List[str]
    checkpoint_problem: Optional[str]


def all_cases() -> List[Case]:
    return [c for c in (Case(s, w, r, f) for s in ("map", "iterable", "presharded") for w in (0, 2) for r in (1, 2)
                        for f in FAULTS) if c.applies()]


def overrides(case: Case, root: Path, cache: Optional[Path] = None) -> List[str]:
    data = root / "train.jsonl"
    run = root / "run"
    args = ["debug=fast", "trainer.log_every=1", "data.cutoff_len=64", f"data.num_workers={case.workers}",
            f"dataset.paths=[{data}]", "trainer.max_steps=400", "trainer.save_every=2", "trainer.eval_every=0",
            "trainer.export=false", "dataset.val_size=0", "trainer.eval_at_start=false",
            f"data.cache_dir={cache or root / 'cache'}", f"trainer.output_dir={run}", f"hydra.run.dir={run}",
            f"launcher.peer_timeout_s={PEER_TIMEOUT_S}"]
    if case.strategy == "presharded":
        args += ["data=presharded", f"data.shard_dir={root / 'parts'}", "dataset.max_samples=null",
                 "data.shuffle_buffer=16"]  # a change is seen at the first read after it: a small buffer reads soon
    elif case.strategy == "iterable":
        args += ["data=iterable", "data.block_bytes=4096", "data.prescan=false", "dataset.max_samples=null"]
    else:
        args += ["dataset.max_samples=400"]
    if case.world == 1:
        return args + ["launcher=local"]
    return args + ["launcher=deepspeed", f"launcher.num_gpus={case.world}"]


def env() -> Dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")}
    e.pop(MARK_ENV, None)
    e.update({"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
              "HF_HUB_OFFLINE": "1"})
    return e


def run_case(case: Case, root: Path, cache: Optional[Path] = None, start_timeout: float = 300) -> Outcome:
    """Run `case` in `root` (`cache`: data.cache_dir shared by cases; map tokenizes once)."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copy(SAMPLE, root / "train.jsonl")
    console = root / "console.log"
    if case.fault == "file_changed":
        cache = None  # (map: its own prepared cache is changed)
    if case.strategy == "presharded":
        subprocess.run([sys.executable, "-m", "dsrecipes", "shard", str(root / "train.jsonl"), "--parts",
                        str(case.world), "--out", str(root / "parts")], cwd=REPO, env=env(), check=True,
                       capture_output=True, timeout=300)
    with open(console, "w") as out:
        proc = subprocess.Popen(["/bin/sh", "-c", f'{MARK_ENV}=$$ exec "$@"', "sh", sys.executable, "-m",
                                 "dsrecipes", *overrides(case, root, cache)], cwd=REPO, env=env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        reached = wait_for_step(root / "run", INJECT_AT, proc, start_timeout)
        assert reached, f"{case.name}: step {INJECT_AT} not reached:\n{console.read_text()[-3000:]}"
        at = time.monotonic()
        inject(case, root, proc)
        code = wait_exit(proc, case.bound_s)
        left = wait_session_gone(proc.pid, at + case.bound_s)
        seconds = time.monotonic() - at if not left else float("inf")
    finally:
        kill_session(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return Outcome(case, seconds, code, console.read_text(), read_json(root / "run" / "result.json"), left,
                   previous_checkpoint_problem(root / "run"))


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            lines = (run / "metrics.jsonl").read_text().splitlines()
        except OSError:
            lines = []
        if any('"loss"' in x and json.loads(x).get("step", 0) >= step for x in lines if x.strip()):
            return True
        time.sleep(0.1)
    return False


def inject(case: Case, root: Path, proc: subprocess.Popen) -> None:
    if case.fault == "file_changed":  # iterable: the corpus; presharded: the parts; map: the prepared cache
        targets = {"iterable": [root / "train.jsonl"], "presharded": sorted((root / "parts").glob("*.jsonl")),
                   "map": sorted((root / "cache").rglob("*.arrow"))}[case.strategy]
        assert targets, case.name
        for path in targets:
            with open(path, "ab") as fh:  # appended: what a memory-mapped reader can still survive
                fh.write(b"\n" * 16)
    elif case.fault == "launcher_killed":
        os.kill(proc.pid, signal.SIGKILL)
    elif case.fault == "worker_killed":
        os.kill(workers_of(ranks(proc.pid)[-1])[0], signal.SIGKILL)
    elif case.fault == "rank_killed":
        os.kill(ranks(proc.pid)[-1], signal.SIGKILL)
    elif case.fault == "rank_stopped":
        os.kill(ranks(proc.pid)[-1], signal.SIGSTOP)
    else:
        raise ValueError(case.fault)


MARK_ENV = "DSRECIPES_FAULT_CASE"  # every process of a case inherits it: found even after it was reparented


def session(sid: int) -> List["object"]:
    """Every live process of the case whose launching process is `sid` (its marker in the environment)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get(MARK_ENV) == str(sid):
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def ranks(sid: int) -> List[int]:
    """The rank processes of the run in session `sid`, by rank (launcher=local: the launching process)."""
    procs = session(sid)
    by_rank = {}
    for p in procs:
        cmd = p.info["cmdline"] or []
        try:
            rank = p.environ().get("RANK")
        except Exception:  # noqa: BLE001
            continue
        if "dsrecipes.rank.worker" in cmd and rank is not None and p.ppid() not in [q.pid for q in procs
                                                                                     if q.pid in by_rank.values()]:
            by_rank.setdefault(int(rank), p.pid)
    return [by_rank[r] for r in sorted(by_rank)] or [sid]


def workers_of(pid: int) -> List[int]:
    """DataLoader workers of a rank: its children running the rank's own command line (forked)."""
    import psutil

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        parent = psutil.Process(pid)
        kids = [c.pid for c in parent.children() if c.cmdline() == parent.cmdline()]
        if kids:
            return kids
        time.sleep(0.1)
    raise AssertionError(f"no DataLoader worker under rank pid {pid}")


def wait_exit(proc: subprocess.Popen, bound: float) -> Optional[int]:
    try:
        return proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        return None


def wait_session_gone(sid: int, deadline: float) -> List[str]:
    while True:
        left = [f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:160]}" for p in session(sid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_session(sid: int) -> None:
    for p in session(sid):
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass


def read_json(path: Path) -> Dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def previous_checkpoint_problem(run: Path) -> Optional[str]:
    """None when the newest committed checkpoint verifies (at least step 2)."""
    from dsrecipes.boundary.checkpoint_find import committed, damage

    newest = committed(run / "checkpoints")
    if not newest:
        return "no committed checkpoint"
    return damage(newest[0])


def expected_cause(case: Case) -> str:
    return {"file_changed": "changed since", "worker_killed": "DataLoader worker", "rank_killed": "rank",
            "rank_stopped": "stopped responding", "launcher_killed": ""}[case.fault]


def problems(o: Outcome) -> List[str]:
    """What a user would object to in this outcome (empty: the case passes)."""
    found = []
    if o.left:
        found.append(f"processes left: {o.left}")
    if o.code is None:
        found.append(f"did not end within {o.case.bound_s:.0f} s")
    if "Traceback" in o.console:
        found.append("a traceback on the console")
    if o.checkpoint_problem is not None:
        found.append(f"previous checkpoint: {o.checkpoint_problem}")
    if o.case.fault != "launcher_killed":
        if o.code == 0 or o.result.get("status") != "failed":
            found.append(f"status {o.result.get('status')!r}, exit {o.code}")
        if expected_cause(o.case) not in str(o.result.get("error")):
            found.append(f"result.json error {o.result.get('error')!r} does not name {expected_cause(o.case)!r}")
    return found
