"""The fault-injection harness of tests/test_fault_matrix.py and scripts/fault_matrix.py (issue 43): a real
`python -m dsrecipes` run in a session of its own, a fault injected once it has trained past its first checkpoint,
then what a sceptical user would check: it ended by itself within its bound, failed with the cause named, printed
no traceback, left no process of its session, and its previous checkpoint still verifies.

Faults (injected at step INJECT_AT, after the checkpoint at step 2):
  file_changed     the data grows under the run (iterable: the corpus; presharded: the parts; map: the prepared cache)
  worker_killed    one DataLoader worker of the last rank gets SIGKILL (what the OOM killer sends)
  rank_killed      the last rank gets SIGKILL (a segfault, the OOM killer on the rank itself)
  rank_stopped     the last rank gets SIGSTOP (stuck in a driver call): the heartbeat notices (world 2 only)
  store_stalled    (iterable, corpus in the local S3 server) the proxy in front of the store stops answering: the
                   read fails within data.read_deadline_s
  launcher_killed  the launching process gets SIGKILL: no rank or worker may outlive it

With `resume=True` the fault is then repaired (the data put back, the store answering again) and the same command
runs again: it must resume from the newest checkpoint and replay exactly what the faulty session trained - the same
sample ids per step in every rank's ledger and the same losses - until it is stopped with SIGTERM two steps later.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
INJECT_AT = 3  # the step after which the fault is injected (a checkpoint exists at step 2)
PEER_TIMEOUT_S = 8
READ_DEADLINE_S = 10
WORKER_REPORT_S = 5  # a DataLoader worker's SIGKILL is in failure.json this soon (SIGCHLD: no peer to wait for)
WORKER_SEARCH_S = 30  # a rank's DataLoader workers found (they exist from the first step: only an epoch's turnover)
FAULTS = ("file_changed", "worker_killed", "rank_killed", "rank_stopped", "store_stalled", "launcher_killed")
BUCKET = "fault-matrix"


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
        return {"rank_stopped": PEER_TIMEOUT_S + 30, "store_stalled": READ_DEADLINE_S + 30}.get(self.fault, 30)

    def applies(self) -> bool:
        if self.fault == "worker_killed" and self.workers == 0:
            return False
        if self.fault == "store_stalled" and self.strategy != "iterable":  # map and presharded read the store
            return False  # before training (prepare) or from local parts here
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
    resumed: Optional["Resumed"] = None
    reported_s: Optional[float] = None  # from the fault to the first rank's report in failure.json (None: none)


@dataclass
class Resumed:
    from_step: Optional[int]  # the newest committed checkpoint when the same command ran again
    first_step: Optional[int]  # the first step the second session trained
    compared: int  # steps both sessions trained: sample ids (every rank) and losses compared
    code: Optional[int]  # the second session's exit code after SIGTERM
    problem: Optional[str]


class Store:
    """The local S3 server and a stalling proxy in front of it (tests/helpers/s3server.py)."""

    def __init__(self, server) -> None:
        from tests.helpers.s3server import FaultProxy

        self.server = server
        self.proxy = FaultProxy(server.port).start()

    def env(self) -> Dict[str, str]:
        return self.server.env(self.proxy.endpoint)

    def put(self, key: str, path: Path) -> str:
        import boto3

        e = self.server.env()
        client = boto3.client("s3", endpoint_url=e["AWS_ENDPOINT_URL"], region_name="us-east-1",
                              aws_access_key_id=e["AWS_ACCESS_KEY_ID"], aws_secret_access_key=e["AWS_SECRET_ACCESS_KEY"])
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())
        return f"s3://{BUCKET}/{key}"

    def stop(self) -> None:
        self.proxy.unstall()
        self.proxy.stop()


def all_cases() -> List[Case]:
    return [c for c in (Case(s, w, r, f) for s in ("map", "iterable", "presharded") for w in (0, 2) for r in (1, 2)
                        for f in FAULTS) if c.applies()]


def overrides(case: Case, root: Path, cache: Optional[Path] = None, data: object = None) -> List[str]:
    data = data or root / "train.jsonl"
    run = root / "run"
    args = ["debug=fast", "trainer.log_every=1", "data.cutoff_len=64", f"data.num_workers={case.workers}",
            f"dataset.paths=[{data}]", "trainer.max_steps=400", "trainer.save_every=2", "trainer.eval_every=0",
            "trainer.export=false", "dataset.val_size=0", "trainer.eval_at_start=false",
            f"data.cache_dir={cache or root / 'cache'}", f"trainer.output_dir={run}", f"hydra.run.dir={run}",
            f"launcher.peer_timeout_s={PEER_TIMEOUT_S}", "trainer.record_samples=true"]
    if case.strategy == "presharded":
        args += ["data=presharded", f"data.shard_dir={root / 'parts'}", "dataset.max_samples=null",
                 "data.shuffle_buffer=16"]  # a change is seen at the first read after it: a small buffer reads soon
    elif case.strategy == "iterable":
        args += ["data=iterable", "data.block_bytes=4096", "data.prescan=false", "dataset.max_samples=null"]
        if case.fault == "store_stalled":  # small reads all along, so the stall is met at a read, not after it
            args += ["data.read_ahead_bytes=4096", "data.span_bytes=4096", f"data.read_deadline_s={READ_DEADLINE_S}"]
    else:
        args += ["dataset.max_samples=400"]
    if case.world == 1:
        return args + ["launcher=local"]
    return args + ["launcher=deepspeed", f"launcher.num_gpus={case.world}"]


def env(store: Optional[Store] = None) -> Dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                          "MASTER_PORT")}
    e.pop(MARK_ENV, None)
    e.update({"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
              "HF_HUB_OFFLINE": "1"})
    return {**e, **(store.env() if store else {})}


def start(args: List[str], root: Path, console: Path, store: Optional[Store],
          extra: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """`python -m dsrecipes ARGS` in a session of its own, every process of it marked (MARK_ENV); `extra`: more
    environment (tests/faults.py's fault_env)."""
    with open(console, "a") as out:
        return subprocess.Popen(["/bin/sh", "-c", f'{MARK_ENV}=$$ exec "$@"', "sh", sys.executable, "-m",
                                 "dsrecipes", *args], cwd=REPO, env={**env(store), **(extra or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def end(proc: subprocess.Popen) -> None:
    kill_session(proc.pid)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def run_case(case: Case, root: Path, cache: Optional[Path] = None, start_timeout: float = 300,
             store: Optional[Store] = None, resume: bool = False) -> Outcome:
    """Run `case` in `root` (`cache`: data.cache_dir shared by cases; map tokenizes once; `store`: needed by
    store_stalled; `resume`: then repair the fault and check the same command resumes exactly)."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copy(SAMPLE, root / "train.jsonl")
    console = root / "console.log"
    if case.fault == "file_changed":
        cache = None  # (map: its own prepared cache is changed)
    data = None
    if case.fault == "store_stalled":
        assert store is not None, f"{case.name} needs the local S3 server"
        data = store.put(f"{case.name}/train.jsonl", root / "train.jsonl")
    if case.strategy == "presharded":
        subprocess.run([sys.executable, "-m", "dsrecipes", "shard", str(root / "train.jsonl"), "--parts",
                        str(case.world), "--out", str(root / "parts")], cwd=REPO, env=env(), check=True,
                       capture_output=True, timeout=300)
    args = overrides(case, root, cache, data)
    proc = start(args, root, console, store if data else None)
    try:
        reached = wait_for_step(root / "run", INJECT_AT, proc, start_timeout)
        assert reached, f"{case.name}: step {INJECT_AT} not reached:\n{console.read_text()[-3000:]}"
        originals = {p: p.read_bytes() for p in fault_targets(case, root)}
        at = inject(case, root, proc, store)
        fault_wall = time.time() - (time.monotonic() - at)
        code = wait_exit(proc, case.bound_s)
        left = wait_session_gone(proc.pid, at + case.bound_s)
        seconds = time.monotonic() - at if not left else float("inf")
    finally:
        end(proc)
    outcome = Outcome(case, seconds, code, console.read_text(), read_json(root / "run" / "result.json"), left,
                      previous_checkpoint_problem(root / "run"))
    failure = read_json(root / "run" / "failure.json")
    outcome.reported_s = failure["time"] - fault_wall if isinstance(failure.get("time"), (int, float)) else None
    if resume and not outcome.left and outcome.checkpoint_problem is None:
        for path, content in originals.items():  # the fault repaired: the data as it was, the store answering
            path.write_bytes(content)
        if store is not None:
            store.proxy.unstall()
        outcome.resumed = resume_again(case, root, args, console, store if data else None, start_timeout)
    return outcome


def resume_again(case: Case, root: Path, args: List[str], console: Path, store: Optional[Store],
                 start_timeout: float) -> Resumed:
    """The same command again: it resumes from the newest checkpoint and trains what the faulty session trained
    (sample ids of every rank, losses) until SIGTERM stops it two steps in."""
    from dsrecipes.boundary.checkpoint_find import committed

    run = root / "run"
    newest = committed(run / "checkpoints")
    from_step = int(newest[0].name.split("_")[-1]) if newest else None
    if from_step is None:
        return Resumed(None, None, 0, None, "no committed checkpoint to resume from")
    before = {r: ledger_sessions(run, r) for r in range(case.world)}
    losses_before = step_losses(run)
    proc = start(args, root, console, store)
    try:
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline and proc.poll() is None:
            new = ledger_sessions(run, 0)[len(before[0]):]
            if new and any(step >= from_step + 2 for step in new[0]):
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # what a scheduler's preemption sends; the run saves and ends
        code = wait_exit(proc, 60)
        left = wait_session_gone(proc.pid, time.monotonic() + 10)
    finally:
        end(proc)
    resumed = compare_sessions(case, run, before, losses_before, from_step, code)
    if code is None or left:
        resumed.problem = resumed.problem or f"SIGTERM did not end the second session within 60 s (left: {left})"
    return resumed


def compare_sessions(case: Case, run: Path, before: Dict[int, List[Dict[int, list]]], losses_before: Dict[int, float],
                     from_step: int, code: Optional[int]) -> Resumed:
    first_step, compared, problem = None, 0, None
    for r in range(case.world):
        sessions = ledger_sessions(run, r)[len(before[r]):]
        if not sessions or not sessions[0]:
            return Resumed(from_step, None, 0, code, f"rank {r}: the same command trained no step")
        faulty, again = before[r][-1], sessions[0]
        first_step = min(again)
        if first_step != from_step + 1:
            problem = f"rank {r}: resumed at step {first_step}, not {from_step + 1}"
        same = sorted(set(faulty) & set(again))
        compared = len(same)
        for step in same:
            if faulty[step] != again[step]:
                problem = problem or f"rank {r} step {step}: samples {again[step]} != {faulty[step]} before"
    losses = step_losses(run)
    for step in sorted(set(losses) & set(losses_before)):
        if step > from_step and abs(losses[step] - losses_before[step]) > 1e-6 * max(1.0, abs(losses_before[step])):
            problem = problem or f"step {step}: loss {losses[step]} != {losses_before[step]} before the fault"
    return Resumed(from_step, first_step, compared, code, problem)


def ledger_sessions(run: Path, rank: int) -> List[Dict[int, list]]:
    """{step: sample ids} of each session of one rank's ledger (a `{"session": ...}` line opens each)."""
    sessions: List[Dict[int, list]] = []
    try:
        text = (run / "ledger" / f"rank{rank}.jsonl").read_text(encoding="utf-8")
    except OSError:
        return sessions
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line being written
        if "session" in rec:
            sessions.append({})
        elif sessions and "step" in rec:
            sessions[-1][rec["step"]] = rec.get("ids")
    return sessions


def step_losses(run: Path) -> Dict[int, float]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "loss" in rec and "step" in rec:
            found[rec["step"]] = rec["loss"]
    return found


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


def fault_targets(case: Case, root: Path) -> List[Path]:
    """The files file_changed changes (iterable: the corpus; presharded: the parts; map: the prepared cache)."""
    if case.fault != "file_changed":
        return []
    return {"iterable": [root / "train.jsonl"], "presharded": sorted((root / "parts").glob("*.jsonl")),
            "map": sorted((root / "cache").rglob("*.arrow"))}[case.strategy]


def inject(case: Case, root: Path, proc: subprocess.Popen, store: Optional[Store] = None) -> float:
    """Inject the fault; returns when it struck (time.monotonic()), after finding its target: the time spent looking
    for a rank or a DataLoader worker is not charged to the run's bound."""
    if case.fault == "worker_killed":
        return kill_a_worker(ranks(proc.pid)[-1])
    if case.fault in ("rank_killed", "rank_stopped"):
        target = ranks(proc.pid)[-1]
        at = time.monotonic()
        os.kill(target, signal.SIGKILL if case.fault == "rank_killed" else signal.SIGSTOP)
        return at
    at = time.monotonic()
    if case.fault == "file_changed":
        targets = fault_targets(case, root)
        assert targets, case.name
        for path in targets:
            with open(path, "ab") as fh:  # appended: what a memory-mapped reader can still survive
                fh.write(b"\n" * 16)
    elif case.fault == "store_stalled":
        store.proxy.stall()
    elif case.fault == "launcher_killed":
        os.kill(proc.pid, signal.SIGKILL)
    else:
        raise ValueError(case.fault)
    return at


def kill_a_worker(rank_pid: int, bound_s: float = WORKER_SEARCH_S) -> float:
    """SIGKILL one live DataLoader worker of the rank; returns when. A worker that ended by itself between being
    found and the kill (an epoch's iterator shutting down) is not the fault: the next one found gets it."""
    deadline = time.monotonic() + bound_s
    while True:
        target = workers_of(rank_pid, max(0.0, deadline - time.monotonic()))[0]
        at = time.monotonic()
        try:
            os.kill(target, signal.SIGKILL)
            return at
        except ProcessLookupError:
            if time.monotonic() > deadline:
                raise AssertionError(f"every DataLoader worker of rank pid {rank_pid} ended before its SIGKILL "
                                     f"within {bound_s:.0f} s") from None


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
    """The rank processes of the run in session `sid`, by rank (launcher=local: the launching process). A rank is
    a `dsrecipes.rank.worker` process with RANK set whose parent is not one (its DataLoader workers inherit both),
    whatever order the processes are listed in (pids wrap around)."""
    candidates: Dict[int, tuple] = {}
    for p in session(sid):
        try:
            rank = p.environ().get("RANK")
            if "dsrecipes.rank.worker" in (p.info["cmdline"] or []) and rank is not None:
                candidates[p.pid] = (int(rank), p.ppid())
        except Exception:  # noqa: BLE001 - a process that ended meanwhile
            continue
    by_rank: Dict[int, int] = {}
    for pid, (rank, ppid) in sorted(candidates.items()):
        if ppid not in candidates:
            by_rank.setdefault(rank, pid)
    return [by_rank[r] for r in sorted(by_rank)] or [sid]


def workers_of(pid: int, bound_s: float = WORKER_SEARCH_S) -> List[int]:
    """Live DataLoader workers of a rank: its children running the rank's own command line (forked). Children that
    end while being looked at (an epoch's workers shutting down, a zombie) are skipped, not raised; workers exist
    from the first step on, so `bound_s` only covers an epoch's turnover on a loaded machine."""
    import psutil

    deadline = time.monotonic() + bound_s
    seen: List[str] = []
    while True:
        try:
            parent = psutil.Process(pid)
            own, children = parent.cmdline(), parent.children()
        except psutil.Error as exc:
            raise AssertionError(f"rank pid {pid} ended before a DataLoader worker was seen ({exc!r})") from None
        kids, seen = [], []
        for c in children:
            try:
                if c.status() != psutil.STATUS_ZOMBIE and c.cmdline() == own:
                    kids.append(c.pid)
                seen.append(f"{c.pid} {c.status()}")
            except psutil.Error:  # (NoSuchProcess, ZombieProcess, AccessDenied) it ended while looked at
                continue
        if kids:
            return kids
        if time.monotonic() > deadline:
            raise AssertionError(f"no DataLoader worker under rank pid {pid} within {bound_s:.0f} s "
                                 f"(its children: {seen or 'none'})")
        time.sleep(0.1)


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
            "rank_stopped": "stopped responding", "store_stalled": "unreadable after", "launcher_killed": ""}[case.fault]


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
    if o.case.fault == "worker_killed" and (o.reported_s is None or o.reported_s > WORKER_REPORT_S):
        found.append(f"the rank reported its dead worker {o.reported_s} s after the fault, not within "
                     f"{WORKER_REPORT_S} s: the cause is local, there is no peer to wait for")
    if o.resumed is not None and o.resumed.problem:
        found.append(f"resume: {o.resumed.problem}")
    return found


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """`http://127.0.0.1:PORT` of a server that accepts connections and never answers (a stalled store, a hung
    tracking server); closed on exit."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: List[object] = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(64)], daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


def outcome_within(call: Callable[[], object], bound_s: float) -> Tuple[object, float]:
    """(what `call` returned or raised, seconds it took), run in a daemon thread; AssertionError when it is still
    waiting after `bound_s` (a hostile test's wait never hangs the suite, on the old code either)."""
    outcome: List[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=bound_s)
    assert not thread.is_alive(), f"still waiting after {bound_s:g} s"
    return outcome[0], time.monotonic() - started
