"""The data guarantees of tracker issue 4, end to end: real `deepspeed --num_gpus 2` CPU runs through
`python -m dsrecipes` with `trainer.record_samples=true`, checked on the sample ledgers they write.

Every claim is checked twice: by `dsrecipes.data.plan.ledger.verify_ledgers` (the tool users run) and by assertions on
the raw `<run>/ledger/rank<R>.jsonl` lines parsed here, independently of `read_ledger`.

Data: three JSONL files of very different sizes (60, 15 and 4 rows of the bundled sample data; ids from the row's
`id` field or `<file>:<line>`), fewer files than readers (2 ranks x 2 DataLoader workers), shuffle buffer 8 (so the
stream is shuffled window by window, several windows in each reader's ~20 samples), micro batch 4 x grad_accum 2 x
2 ranks = 16 per step: 79 samples -> 4 steps per epoch, remainder 15; 2 epochs = 8 steps. (Every check below holds
for any such sizes; these are the smallest that keep a mid-epoch checkpoint before the kill, a replay that crosses
into the next epoch and several shuffle windows per reader, so the four launches spend their time on the checks.)

The files are written here AND put, byte for byte, on a real S3-API server (moto's standalone server, the session's
`s3_server`) under s3://dsr-guarantees/train/, and the runs read them from there: one run serves both these data
guarantees and the object-store guarantees of issue 23 (identity by ETag, the credentials nowhere in the run
directory or its output, a shard written into the store and each rank reading only its own part straight from it)
that tests/test_store_e2e.py would otherwise need runs of its own for. (Local files under the same strategies are
trained by test_stream_e2e and test_dpo_strategies; the local copies here feed the 3-part shard dir.)

Runs (module fixtures, shared between tests):
  iterable           data=iterable from s3://dsr-guarantees/train/*.jsonl, data.num_samples=79, trainer.epochs=2,
                     trainer.max_steps=null, save_every=3
  iterable_killed    the same command, every rank killed while saving step 6 (before `latest`), so the last good
                     checkpoint is step 3, in the middle of epoch 0; then the same command again (resume=auto),
                     which replays steps 4-6 and crosses into epoch 1. (save_every = total/2 would put the
                     checkpoint exactly on the epoch boundary with 2 epochs; mid-epoch is the harder case.)
  presharded         `dsrecipes shard s3://.../train/*.jsonl --out s3://dsr-guarantees/parts2` (in-process:
                     `dsrecipes.cli.main`, the function `python -m dsrecipes` calls), then the training command it
                     printed (data=presharded, data.shard_dir=s3://...), run as printed in a shell
  + a 3-part shard dir (of the local copies) under world size 2: exit 2 with the re-shard hint, before any rank
    starts (in-process: `dsrecipes.cli.main`, nothing to launch)
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tests.conftest import in_process_environ, subprocess_env
from tests.helpers.s3server import SECRET
from tests.test_train_runs import SHORT, train_run

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
FILES = {"big.jsonl": 60, "mid.jsonl": 15, "tiny.jsonl": 4}  # uneven, fewer files than the 4 readers
NUM_SAMPLES = sum(FILES.values())  # 79
RANKS, MICRO, ACCUM = 2, 4, 2
GLOBAL_BATCH = RANKS * MICRO * ACCUM  # 16
STEPS_PER_EPOCH = NUM_SAMPLES // GLOBAL_BATCH  # 4
REMAINDER = NUM_SAMPLES - STEPS_PER_EPOCH * GLOBAL_BATCH  # 15
EPOCHS = 2
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH  # 8
SAVE_EVERY = 3  # checkpoints at 3, 6 and 8
KILLED_AT = 6  # dies while saving step 6: resumes from step 3 (epoch 0, micro-batch 6 of 8 per rank)
RESUMED_FROM = 3
STORE = "s3://dsr-guarantees"  # a bucket of this file's own: under `-n 0` the session's server is shared
TRAIN_GLOB = f"{STORE}/train/*.jsonl"
STORE_ENV = {"AWS_SECRET_ACCESS_KEY": SECRET}  # what the runs' environment holds anyway (s3_server), said explicitly

COMMON = (
    "trainer.record_samples=true",
    "trainer.export=false",
    f"trainer.micro_batch_size={MICRO}",
    f"trainer.grad_accum={ACCUM}",
    "trainer.max_steps=null",
    f"trainer.epochs={EPOCHS}",
    f"trainer.save_every={SAVE_EVERY}",
    "dataset.max_samples=null",
    "dataset.val_size=0",  # no validation hold-out: every row of the files is a training sample
    "data.num_workers=2",
    "data.shuffle=true",
    "data.shuffle_buffer=8",
)


# ---------------------------------------------------------------------------------------------------------------
# Data and runs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("guarantees")


@pytest.fixture(scope="module")
def shards(workspace, s3_server) -> tuple[list[Path], set[str]]:
    """The three uneven JSONL files (here, and the same bytes in the store under TRAIN_GLOB) and every sample id."""
    from dsrecipes.data.sources.remote import s3

    lines = [ln for ln in SAMPLE.read_text(encoding="utf-8").splitlines(keepends=True) if ln.strip()]
    out_dir = workspace / "data"
    out_dir.mkdir()
    fs = s3()
    fs.mkdir(STORE)
    paths, ids, start = [], set(), 0
    for name, n in FILES.items():
        chunk = lines[start:start + n]
        start += n
        assert len(chunk) == n
        (out_dir / name).write_text("".join(chunk), encoding="utf-8")
        fs.pipe(f"{STORE}/train/{name}", "".join(chunk).encode())
        paths.append(out_dir / name)
        for line_no, line in enumerate(chunk, 1):
            row = json.loads(line)
            ids.add(str(row["id"]) if row.get("id") else f"{name}:{line_no}")  # the documented sample id
    assert len(ids) == NUM_SAMPLES
    assert any(":" in i for i in ids) and any(":" not in i for i in ids)  # both id kinds are exercised
    return paths, ids


def iterable_overrides() -> tuple[str, ...]:
    return (*COMMON, "data=iterable", f"data.num_samples={NUM_SAMPLES}", f"dataset.paths=[{TRAIN_GLOB}]")


@pytest.fixture(scope="module")
def iterable_run(workspace, shards) -> tuple[Path, str]:
    """The uninterrupted data=iterable run from the store: (run directory, its output)."""
    return train_run(workspace, "iterable", *iterable_overrides(), env=STORE_ENV)


@pytest.fixture(scope="module")
def sharding(workspace, shards) -> tuple[str, str]:
    """`dsrecipes shard s3://... --parts 2 --out s3://.../parts2 <training overrides>`, for real (in this process:
    what it does is not about a process boundary): the parts' URL and the training command it printed."""
    from dsrecipes.cli import main as cli

    out = f"{STORE}/parts2"
    training = [*SHORT, *COMMON, f"data.cache_dir={workspace / 'cache'}",
                f"trainer.output_dir={workspace / 'presharded'}"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with in_process_environ(), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli(["shard", TRAIN_GLOB, "--parts", "2", "--out", out, *training])
    assert code == 0, (stdout.getvalue() + stderr.getvalue())[-4000:]
    assert not list((workspace / "cache").glob("shard-staging-*")), "the staging directory is removed"
    (line,) = [ln for ln in stdout.getvalue().splitlines() if ln.startswith("train with: ")]
    return out, line[len("train with: "):]


@pytest.fixture(scope="module")
def shard_dir(sharding) -> str:
    return sharding[0]


@pytest.fixture(scope="module")
def presharded_run(workspace, sharding) -> tuple[Path, str]:
    """The command `dsrecipes shard` printed, run exactly as printed (`python` = this interpreter): (run directory,
    its output)."""
    import os

    out, command = sharding
    assert f"data.shard_dir={out} " in command
    assert command.startswith(f"python -m dsrecipes data=presharded data.shard_dir={out} launcher=deepspeed "
                              "launcher.num_gpus=2 ")  # fmt: skip
    env = subprocess_env({"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **STORE_ENV})
    proc = subprocess.run(["bash", "-c", command], cwd=workspace, env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return workspace / "presharded", proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# Raw ledger lines, parsed here (not with read_ledger)

Line = tuple[int, int, list[str]]  # (epoch, step, ids) of one record() call = one micro-batch


def raw_sessions(run: Path, rank: int) -> list[list[Line]]:
    """The lines of one rank's ledger, split at each `{"session": ...}` header (one session per process)."""
    sessions: list[list[Line]] = []
    for text in (run / "ledger" / f"rank{rank}.jsonl").read_text(encoding="utf-8").splitlines():
        if not text.strip():
            continue
        rec = json.loads(text)
        if "session" in rec:
            sessions.append([])
            continue
        assert sessions, f"rank {rank}: a ledger line before the first session header"
        assert set(rec) == {"epoch", "step", "ids", "keys"} and len(rec["keys"]) == len(rec["ids"]), rec
        sessions[-1].append((rec["epoch"], rec["step"], rec["ids"]))
    return sessions


def by_step(lines: list[Line]) -> dict[int, tuple[int, list[list[str]]]]:
    """step -> (epoch, micro-batches in recorded order); checks each step has grad_accum full micro-batches."""
    out: dict[int, tuple[int, list[list[str]]]] = {}
    for epoch, step, ids in lines:
        prev_epoch, micros = out.setdefault(step, (epoch, []))
        assert prev_epoch == epoch, f"step {step} recorded under epochs {prev_epoch} and {epoch}"
        micros.append(ids)
    for step, (_, micros) in out.items():
        assert len(micros) == ACCUM and all(len(m) == MICRO for m in micros), (step, micros)
    steps = [s for _, s, _ in lines]
    assert steps == sorted(steps), "steps recorded out of order"
    return out


def single_session(run: Path, rank: int) -> dict[int, tuple[int, list[list[str]]]]:
    sessions = raw_sessions(run, rank)
    assert len(sessions) == 1, f"rank {rank}: {len(sessions)} sessions in an uninterrupted run"
    return by_step(sessions[0])


def ids_per_epoch(per_rank: dict[int, dict[int, tuple[int, list[list[str]]]]]) -> dict[int, dict[int, list[str]]]:
    """epoch -> rank -> every id that rank read in the epoch (with repeats, if any)."""
    out: dict[int, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for rank, steps in per_rank.items():
        for epoch, micros in steps.values():
            for m in micros:
                out[epoch][rank].extend(m)
    return out


def assert_step_structure(per_rank: dict[int, dict[int, tuple[int, list[list[str]]]]]) -> None:
    """Both ranks ran steps 1..TOTAL_STEPS, STEPS_PER_EPOCH in each epoch, in epoch order."""
    for rank, steps in per_rank.items():
        assert sorted(steps) == list(range(1, TOTAL_STEPS + 1)), f"rank {rank}: steps {sorted(steps)}"
        assert {s: e for s, (e, _) in steps.items()} == {s: (s - 1) // STEPS_PER_EPOCH
                                                          for s in range(1, TOTAL_STEPS + 1)}, rank


def metrics_lines(run: Path) -> list[dict]:
    return [json.loads(t) for t in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if t.strip()]


def losses(run: Path) -> dict[int, float]:
    train = [r for r in metrics_lines(run) if "loss" in r]
    steps = [r["step"] for r in train]
    assert steps == sorted(set(steps)), f"metrics steps repeated or out of order: {steps}"
    return {r["step"]: r["loss"] for r in train}


def store_text(url: str) -> str:
    from dsrecipes.data.sources.remote import s3

    return s3().cat_file(url).decode("utf-8")


def shard_manifest(shard_dir: str) -> dict:
    return json.loads(store_text(f"{shard_dir}/manifest.json"))


def part_ids(shard_dir: str, part: int) -> list[str]:
    name = shard_manifest(shard_dir)["files"][part]
    return [json.loads(t)["id"] for t in store_text(f"{shard_dir}/{name}").splitlines() if t.strip()]


def assert_store_run(run: Path, out: str) -> None:
    """A run that read the store: finished with the planned steps; the secret key nowhere in its files or output."""
    plan = json.loads((run / "plan.json").read_text())
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == plan["total_steps"] == TOTAL_STEPS
    for path in run.rglob("*"):  # config.yaml, plan.json, logs, ledgers, checkpoints' metadata
        if path.is_file() and path.stat().st_size < 50 << 20:
            assert SECRET.encode() not in path.read_bytes(), f"the secret key leaked into {path}"
    assert SECRET not in out


# ---------------------------------------------------------------------------------------------------------------
# 1. data=iterable over uneven shards, 2 ranks x 2 workers, shuffle buffer, data.num_samples, trainer.epochs=2


def test_iterable_uneven_shards_exactly_once_per_epoch_equal_steps(iterable_run, shards):
    from dsrecipes.data.plan.ledger import verify_ledgers

    iterable_run, _ = iterable_run
    _, expected = shards
    report = verify_ledgers(iterable_run, expected, GLOBAL_BATCH, complete_epochs=range(EPOCHS))
    assert report.ok, report.summary()
    assert report.ranks == RANKS and report.epochs == list(range(EPOCHS))
    assert report.steps_per_rank == {r: TOTAL_STEPS for r in range(RANKS)}
    assert report.missing == {e: REMAINDER for e in range(EPOCHS)}

    per_rank = {r: single_session(iterable_run, r) for r in range(RANKS)}
    assert_step_structure(per_rank)
    unread = {}
    for epoch, ranks in ids_per_epoch(per_rank).items():
        read = [i for r in range(RANKS) for i in ranks[r]]
        dups = [i for i, n in Counter(read).items() if n > 1]
        assert not dups, f"epoch {epoch}: read more than once: {dups}"
        assert set(read) <= expected, f"epoch {epoch}: unknown ids {set(read) - expected}"
        assert all(len(ranks[r]) == STEPS_PER_EPOCH * MICRO * ACCUM for r in range(RANKS))
        unread[epoch] = expected - set(read)
        assert len(unread[epoch]) == REMAINDER < GLOBAL_BATCH
    assert sorted(unread) == list(range(EPOCHS))
    assert unread[0] != unread[1], "the remainder is the same in both epochs: the stream is not reshuffled"

    lines = metrics_lines(iterable_run)
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, TOTAL_STEPS + 1))


def test_iterable_from_the_store_indexes_by_etag_and_keeps_the_secret_out(iterable_run):
    """(issue 23) The readers read their own blocks of the store's objects with ranged GETs: the stream index names
    the s3:// objects the glob matched, identified by ETag (their contents were not hashed); the run finished with
    the planned steps, and the secret key is in none of its files and not in its output."""
    from dsrecipes.data.stream.index import read_stream_index

    run, out = iterable_run
    assert_store_run(run, out)
    index = read_stream_index(run)
    assert [f.path for f in index.files] == [f"{STORE}/train/{n}" for n in sorted(FILES)]
    assert all(f.digest.startswith("s3-") for f in index.files)  # identity = ETag, the contents were not hashed


def test_the_per_node_launcher_ends_promptly_after_its_ranks(monkeypatch):
    """Every launch in this file goes through DeepSpeed's per-node launcher (run/launch/ds_node.py: DeepSpeed's own
    `main()`), whose wait for its ranks slept 1 s between looks at them, also after the last one had ended: each run
    ended 1-2 s after its ranks (in the launches here: result.json 1.2-1.5 s after launcher.log noted the last rank's
    end). Its real main() here, in-process, starting two ranks that end at once (`true`): it returns at once."""
    import signal
    import time

    from dsrecipes.core.deepspeed_import import load_deepspeed
    from dsrecipes.run.launch import ds_node

    load_deepspeed()
    from deepspeed.launcher import launch

    monkeypatch.setattr(launch, "time", launch.time)  # ds_node.main replaces it: put back afterwards
    monkeypatch.setattr(ds_node.gc, "freeze", lambda: None)  # not this test process's objects
    world = "eyJsb2NhbGhvc3QiOiBbMCwgMV19"  # base64 of {"localhost": [0, 1]}: two ranks on this machine
    monkeypatch.setattr(sys, "argv", ["ds_node", f"--world_info={world}", "--master_addr=127.0.0.1",
                                      "--master_port=29500", "--no_python", "--no_local_rank", "true"])  # fmt: skip
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # main() installs its own
    started = time.monotonic()
    try:
        ds_node.main()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    took = time.monotonic() - started
    assert took < 1.0, f"DeepSpeed's launcher took {took:.2f} s over two ranks that ended at once"


def ending_rank(script: str, out: Path) -> subprocess.CompletedProcess:
    """`script` (a process that imported the rank worker and ends through it) run with `out` as its argument."""
    return subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(), check=False)  # fmt: skip


def test_a_rank_that_trained_to_the_end_ends_without_tearing_down_its_modules(tmp_path):
    """Every rank of the runs here ends through `rank.worker.end_trained_rank` once it trained to the end: its other
    threads joined and its atexit handlers run, as at interpreter shutdown, then os._exit(0) without the teardown
    of torch's, transformers' and DeepSpeed's modules (1.3-1.6 s between a rank's last atexit handler and its end,
    measured on the launches of this file). A process that imported the worker, as a rank does, ends through it."""
    script = (
        "import atexit, sys, threading, time\n"
        "from pathlib import Path\n"
        "from dsrecipes.rank import worker\n"
        "out = Path(sys.argv[1])\n"
        "class Teardown:\n"
        "    def __del__(self, _open=open, _path=str(out / 'teardown')):  # nothing looked up at teardown\n"
        "        _open(_path, 'w').close()\n"
        "kept = Teardown()  # a module global: deleted by the teardown only\n"
        "atexit.register(lambda: (out / 'atexit').write_text('ran'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), (out / 'thread').write_text('joined'))).start()\n"
        "print('flushed', end='')\n"
        "worker.end_trained_rank()\n"
        "(out / 'after').write_text('end_trained_rank returned')\n"
    )
    proc = ending_rank(script, tmp_path)
    assert proc.returncode == 0 and proc.stdout == "flushed", (proc.stdout + proc.stderr)[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit", "thread"]


def test_a_trained_ranks_thread_that_never_ends_is_named_and_does_not_hold_the_rank(tmp_path):
    """The interpreter's own shutdown joins non-daemon threads without a bound; end_trained_rank waits THREADS_JOIN_S
    at most, names the thread, runs the atexit handlers and ends."""
    script = (
        "import atexit, sys, threading\n"
        "from pathlib import Path\n"
        "from dsrecipes.rank import worker\n"
        "worker.THREADS_JOIN_S = 0.5\n"
        "atexit.register(lambda: (Path(sys.argv[1]) / 'atexit').write_text('ran'))\n"
        "threading.Thread(target=threading.Event().wait, name='stuck-upload').start()\n"
        "worker.end_trained_rank()\n"
    )
    proc = ending_rank(script, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "thread stuck-upload did not end within 0.5 s of the end of training" in proc.stderr, proc.stderr
    assert (tmp_path / "atexit").read_text() == "ran"


# ---------------------------------------------------------------------------------------------------------------
# 2. data=presharded from `dsrecipes shard`


def test_presharded_each_rank_reads_only_its_part_once_per_epoch(presharded_run, shard_dir, shards):
    """`dsrecipes shard` into the store, then the printed training command: each rank reads only its own part,
    straight from the store, exactly once per epoch."""
    from dsrecipes.data.plan.ledger import read_ledger, verify_ledgers

    presharded_run, out = presharded_run
    _, expected = shards
    manifest = shard_manifest(shard_dir)
    parts = [part_ids(shard_dir, r) for r in range(RANKS)]
    assert manifest["parts"] == RANKS and manifest["counts"] == [len(p) for p in parts]
    assert len(manifest["identities"]) == RANKS
    assert sorted(manifest["counts"]) == [NUM_SAMPLES // 2, NUM_SAMPLES - NUM_SAMPLES // 2]  # balanced +-1
    assert not set(parts[0]) & set(parts[1]) and set(parts[0]) | set(parts[1]) == expected  # ids survive shard
    rank_batch = MICRO * ACCUM
    steps_per_epoch = min(len(p) for p in parts) // rank_batch
    assert steps_per_epoch == STEPS_PER_EPOCH

    assert_store_run(presharded_run, out)
    report = verify_ledgers(presharded_run, expected, GLOBAL_BATCH)
    assert report.ok, report.summary()
    report = verify_ledgers(presharded_run, expected, GLOBAL_BATCH, complete_epochs=range(EPOCHS))
    assert report.ok, report.summary()
    assert report.steps_per_rank == {r: TOTAL_STEPS for r in range(RANKS)}
    for r in range(RANKS):  # the same through read_ledger: (epoch, step) -> ids
        ledger = read_ledger(presharded_run / "ledger" / f"rank{r}.jsonl")
        assert sorted({e for e, _ in ledger}) == list(range(EPOCHS))
        for epoch in range(EPOCHS):
            read = [i for (e, _), batch in ledger.items() if e == epoch for i in batch]
            assert read and set(read) <= set(parts[r]) and len(read) == len(set(read)), (epoch, r)

    per_rank = {r: single_session(presharded_run, r) for r in range(RANKS)}
    assert_step_structure(per_rank)
    for epoch, ranks in ids_per_epoch(per_rank).items():
        for r in range(RANKS):
            read = ranks[r]
            assert set(read) <= set(parts[r]), f"epoch {epoch} rank {r} read ids of another part: " \
                                               f"{sorted(set(read) - set(parts[r]))[:5]}"
            assert len(read) == len(set(read)) == steps_per_epoch * rank_batch, (epoch, r)
    for r in range(RANKS):
        left = [set(parts[r]) - set(ids_per_epoch(per_rank)[e][r]) for e in range(EPOCHS)]
        assert all(len(x) == len(parts[r]) - steps_per_epoch * rank_batch for x in left)
        assert left[0] != left[1], f"rank {r}: the same samples are left out in both epochs"


def test_presharded_part_count_must_match_world_size(workspace, shards, capfd):
    """Refused by the launching process before any rank starts, so it runs in-process (`dsrecipes.cli.main`, the
    function `python -m dsrecipes` calls); capfd also holds anything a launched child would have written."""
    from dsrecipes.cli import main as cli

    three = workspace / "parts3"
    assert cli(["shard", *map(str, shards[0]), "--parts", "3", "--out", str(three)]) == 0
    capfd.readouterr()
    run = workspace / "presharded_3of2"
    argv = [*SHORT, f"data.cache_dir={workspace / 'cache'}", f"trainer.output_dir={run}", f"hydra.run.dir={run}",
            *COMMON, "data=presharded", f"data.shard_dir={three}", "launcher=deepspeed", f"launcher.num_gpus={RANKS}"]
    code = cli(argv)
    captured = capfd.readouterr()
    out = captured.out + captured.err
    assert code == 2, out[-4000:]
    assert f"holds 3 parts but the run has {RANKS} ranks" in out and f"--parts {RANKS}" in out, out[-4000:]
    assert "Traceback" not in out
    # before any rank: no launcher command, no run files, no ledger
    assert "dsrecipes.rank.worker" not in out and "spawned" not in out
    assert not any((run / f).exists() for f in ("config.yaml", "ds_config.json", "launch.txt", "ledger"))


# ---------------------------------------------------------------------------------------------------------------
# 3. Exact resume of data=iterable: killed after the mid-epoch checkpoint, restarted with the same command


@pytest.fixture(scope="module")
def resumed_run(workspace, shards) -> tuple[Path, str]:
    from tests.faults import fault_env

    overrides = iterable_overrides()
    killed = {**fault_env(workspace, kill_before_latest=KILLED_AT), **STORE_ENV}
    run, _ = train_run(workspace, "iterable_killed", *overrides, env=killed, expect_ok=False)
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == f"step_{RESUMED_FROM}"
    assert not (ckpts / f"step_{KILLED_AT}" / "complete.json").exists()
    assert max(losses(run)) == KILLED_AT  # it trained up to the failed save, then died
    killed_sessions = {r: raw_sessions(run, r) for r in range(RANKS)}
    assert all(len(s) == 1 for s in killed_sessions.values())

    _, out = train_run(workspace, "iterable_killed", *overrides, env=STORE_ENV)  # the same command: resume=auto
    assert "resumed from" in out and f"step_{RESUMED_FROM}" in out, out[-3000:]
    return run, out


def test_iterable_resume_replays_the_same_samples_and_losses(resumed_run, iterable_run, shards):
    from dsrecipes.data.plan.ledger import read_ledger, verify_ledgers

    run, _ = resumed_run
    iterable_run, _ = iterable_run
    _, expected = shards
    assert (run / "checkpoints" / "latest").read_text() == f"step_{TOTAL_STEPS}"

    reference = {r: single_session(iterable_run, r) for r in range(RANKS)}
    for r in range(RANKS):
        sessions = raw_sessions(run, r)
        assert len(sessions) == 2, f"rank {r}: {len(sessions)} sessions"
        first, second = by_step(sessions[0]), by_step(sessions[1])
        assert sorted(first) == list(range(1, KILLED_AT + 1)), sorted(first)
        assert sorted(second) == list(range(RESUMED_FROM + 1, TOTAL_STEPS + 1)), sorted(second)
        # the killed session read what the uninterrupted run read, up to where it died ...
        assert first == {s: reference[r][s] for s in first}, f"rank {r}: the killed session diverged"
        # ... and the resumed session re-read the replayed steps 4..6 and went on exactly like it
        union = {**{s: v for s, v in first.items() if s <= RESUMED_FROM}, **second}
        for s in range(1, TOTAL_STEPS + 1):
            assert union[s] == reference[r][s], f"rank {r} step {s}: {union[s]} != {reference[r][s]}"
        assert read_ledger(run / "ledger" / f"rank{r}.jsonl") == read_ledger(iterable_run / "ledger" / f"rank{r}.jsonl")

    report = verify_ledgers(run, expected, GLOBAL_BATCH, complete_epochs=range(EPOCHS))
    assert report.ok, report.summary()
    assert report.missing == {e: REMAINDER for e in range(EPOCHS)}

    resumed, uninterrupted = losses(run), losses(iterable_run)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, TOTAL_STEPS + 1))
    assert resumed == uninterrupted, {s: (resumed[s], uninterrupted[s]) for s in resumed
                                      if resumed[s] != uninterrupted[s]}
