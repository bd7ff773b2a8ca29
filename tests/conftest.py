"""Shared fixtures: compose through the one real road (`compose` + `load_config`), tiny assets, markers."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import pytest

# A watchdog thread of the product (core/heartbeat.py, core/final_barrier.py: `dsrecipes-*` threads) ends its rank
# with os._exit. Tests that run one in this process patch os._exit for their duration; a thread that outlives its test
# (a beat in flight when the fixture stopped it, a store deleted under it) would then call the real one and end this
# pytest worker (xdist: "node down: Not properly terminated", and the run hangs at 99%). In this process only, such a
# thread's os._exit ends the thread instead, and says so; forked children (their main thread) exit as always.
_TEST_PROCESS, _real_exit = os.getpid(), os._exit


def _exit_guard(code: int) -> None:
    import sys
    import threading

    thread = threading.current_thread()
    if os.getpid() == _TEST_PROCESS and thread.name.startswith("dsrecipes-"):
        print(f"tests/conftest.py: thread {thread.name} called os._exit({code}) after its test; the thread ends "
              "instead of the pytest process", file=sys.stderr, flush=True)
        raise SystemExit(code)
    _real_exit(code)


os._exit = _exit_guard

# Each test ends with SIGPIPE's disposition as this process started with it (SIG_IGN, the interpreter's). Until
# 3eac241 `dsrecipes.cli.main` set it to SIG_DFL, tests call `main` in this process, and every later test of this
# pytest worker ran with it: a write to a pipe whose reader had died ended the worker without a word. Seen: the pool
# of test_liveness_prepare_workers sent its killed preparation worker a chunk (strace: write = -1 EPIPE, then killed
# by SIGPIPE), and xdist said "[gw1] node down: Not properly terminated". tests/test_sigpipe_between_tests.py.
_SIGPIPE_AT_START = signal.getsignal(signal.SIGPIPE)


@pytest.fixture(autouse=True)
def _sigpipe_as_this_process_started():
    yield
    if signal.getsignal(signal.SIGPIPE) != _SIGPIPE_AT_START:
        signal.signal(signal.SIGPIPE, _SIGPIPE_AT_START)


@pytest.fixture
def fresh_stopping() -> Iterator[None]:
    """core/stopping's process-wide state (a requested stop, its cause) reset before and after the test: an xdist
    worker runs many tests in one process, and supervision tests leave a cause set (commands/outcome.py reads it)."""
    from dsrecipes.core import stopping

    stopping.reset()
    yield
    stopping.reset()


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def make_cfg() -> Callable[..., object]:
    """make_cfg("data=iterable", "trainer.max_steps=3", check_files=False) -> TrainConfig."""
    from dsrecipes.config.load import compose_and_load

    def _make(*overrides: str, check_files: bool = True):
        return compose_and_load(list(overrides), check_files=check_files)

    return _make


@pytest.fixture
def glaive() -> Path:
    """The real Glaive tool-call demo files (English, Chinese) bundled with dsrecipes."""
    from dsrecipes.core.paths import ASSETS_DIR

    return ASSETS_DIR / "glaive_toolcall"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a local HF directory (scripts/fetch_smollm2.py; scripts/test.sh runs it first and
    sets DSRECIPES_REQUIRE_SMOLLM2=1, so CI fails instead of skipping when it is missing)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fetch_smollm2", REPO / "scripts" / "fetch_smollm2.py")
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
    path = fetch.default_dir()
    if not fetch.is_ready(path):
        message = f"SmolLM2 is not at {path}: run `python scripts/fetch_smollm2.py` (downloads ~93 MB once)"
        if os.environ.get("DSRECIPES_REQUIRE_SMOLLM2") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def require_cxx() -> None:
    """Skip, saying why, where DeepSpeed's JIT builds cannot run: no C++ compiler (torch's cpp_extension calls $CXX,
    else `c++`). scripts/test.sh installs g++ as root with apt-get; a machine without either skips these tests."""
    import shutil

    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx}): DeepSpeed's JIT-built ops cannot build here (scripts/test.sh installs "
                    "g++ as root with apt-get)")


@pytest.fixture(scope="session")
def built_cpu_adam(tmp_path_factory):
    """DeepSpeed's CPU Adam, JIT-built ONCE per test session, for real and cold: `dsrecipes doctor --build-ops
    zero=stage2 offload=cpu_optimizer` with a fresh XDG_CACHE_HOME (no TORCH_EXTENSIONS_DIR), so it builds into this
    environment's directory under that cache. test_doctor checks what the build said; the tests that need the op
    (the optimizer matrix, offloaded training) point TORCH_EXTENSIONS_DIR at the built directory instead of building
    it again (a cold build is 1-2 minutes on a quiet 2-core machine). Returns (env, completed process, build root)."""
    import fcntl
    import json
    import subprocess
    import sys

    from dsrecipes.core import jit_ops

    require_cxx()
    # One build for the whole run, also across pytest-xdist workers (they share the base temp's parent): the first
    # worker builds under a lock and records what doctor said; the others read that record.
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built_cpu_adam"
    shared.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["XDG_CACHE_HOME"] = str(shared / "cache")
    record = shared / "doctor.json"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not record.is_file():
            cmd = [sys.executable, "-m", "dsrecipes", "doctor", "--build-ops", "--json", "zero=stage2",
                   "offload=cpu_optimizer"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, env=env)
            record.write_text(json.dumps([done.args, done.returncode, done.stdout, done.stderr]))
    done = subprocess.CompletedProcess(*json.loads(record.read_text()))
    return env, done, jit_ops.build_root(env)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A plain Hugging Face directory (the tiny model, its tokenizer's own template), one per test module: the model
    directory the trust tests copy and poison (test_trust, test_trust_redteam; modules with a `model_dir` of their
    own keep theirs)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.modeling.model import build_tiny_model, load_tokenizer

    cfg = compose_and_load(["debug=fast"])
    tokenizer = load_tokenizer(cfg)
    base = tmp_path_factory.mktemp("model") / "base"
    build_tiny_model(cfg, tokenizer).save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


# The files that take longest (pytest --durations; measured on a 2-core machine, heaviest first): collected first, so
# that under pytest-xdist (`-n 3 --dist loadfile --no-loadscope-reorder`, the README's test command) the workers
# start on them at once and the run ends on short files, not on one long file alone. xdist's default reorder (files
# with the most tests first) would undo this order. test_doctor comes first: it builds the session's CPU Adam
# (`built_cpu_adam`, a cold JIT build of 2-4 minutes) while the other worker starts test_multinode, so that the files
# needing the op later (test_train_runs, test_optimizers) find it built instead of a worker sitting idle on the
# build's lock (seen: 227 s of test_doctor's setup spent waiting while test_train_runs built it on the other worker).
HEAVY_FIRST = ("test_benchmarks_smoke.py", "test_doctor.py", "test_multinode.py", "test_fault_matrix.py",
               "test_dpo_smollm2.py", "test_grpo_smollm2.py", "test_grpo.py", "test_pipeline_smollm2.py", "test_smollm2.py", "test_train_runs.py", "test_guarantees_e2e.py",
               "test_optimizers.py", "test_eval_runs.py", "test_dpo_strategies.py",
               "test_quickstart.py", "test_config.py", "test_run_safety.py", "test_safety.py", "test_jit_ops.py",
               "test_store_e2e.py", "test_launch_real.py", "test_stream_e2e.py")


# Files that share a session fixture's expensive set-up run in one pytest-xdist worker, as one work unit, so the set-up
# happens once (a session fixture is per worker): test_run_safety's workspace and base run (tiny model, 8 steps) are
# imported by the others.
SAME_WORKER = {name: "safety-base-run" for name in ("test_run_safety.py", "test_hostile_checkpoint.py",
                                                     "test_point_of_use_runs.py", "test_disk_full.py")}


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the SAME_WORKER files as one unit (any other mode: xdist's own scheduler)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope.rsplit("/", 1)[-1], scope)

    return GroupedFiles(config, log)


def pytest_sessionstart(session):
    """Under pytest-xdist each worker has at most one core of the two (scripts/test.sh: `-n 3`): work done inside
    the worker (the launching side of in-process runs: preparing data, DPO reference log-probs, evaluation, export) uses one intra-op
    thread, as every subprocess does (subprocess_env) and as ranks already do (distributed.init_distributed). Two
    threads per worker spin-wait on an oversubscribed host (DPO on SmolLM2: 174 s to prepare with the other worker busy)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def subprocess_env(extra: dict | None = None) -> dict:
    """Environment for real subprocess runs: no inherited rank variables, quiet tokenizers, single-thread BLAS;
    `extra` on top (a None value removes that variable)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return {k: v for k, v in env.items() if v is not None}


@contextmanager
def in_process_environ(env: dict | None = None) -> Iterator[None]:
    """For a run (`dsrecipes.cli.main`, a module's `main`) inside the test process: quiet tokenizers, or exactly `env`
    when given (a rank's environment); afterwards the environment is what it was (a run sets RANK, MASTER_PORT, ...
    for its rank, and none of it may outlive the run)."""
    saved = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def remove_when_passed(request, paths) -> None:
    """Remove `paths` (a directory, or a function that gives the directories when the time comes: a real model's
    checkpoints and exports are GBs) when the requesting fixture is torn down, unless a test failed meanwhile (then
    they stay for a look, as pytest keeps a failed test's tmp_path under tmp_path_retention_policy = "failed",
    pyproject.toml)."""
    import shutil

    failed = request.session.testsfailed

    def finish() -> None:
        if request.session.testsfailed == failed:
            for path in paths() if callable(paths) else [paths]:
                shutil.rmtree(path, ignore_errors=True)

    request.addfinalizer(finish)


@pytest.fixture(scope="session")
def split_pipeline_out(tmp_path_factory):
    """The audit tests' real tiny pipeline (tests/helpers/split_pipeline.py), run once per session and worker."""
    from tests.helpers.split_pipeline import run_pipeline

    return run_pipeline(tmp_path_factory.mktemp("split_pipeline"))


@pytest.fixture(scope="session")
def pipeline_reference(tmp_path_factory):
    """The interrupt tests' tiny pipeline run once uninterrupted (tests/helpers/pipeline_runs.py): what every
    interrupted-then-resumed run must equal. Once per session and worker."""
    from tests.helpers.pipeline_runs import uninterrupted

    return uninterrupted(tmp_path_factory.mktemp("pipeline_reference"))


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-API server (moto's standalone server on 127.0.0.1) for the whole session; this process's
    environment points at it (AWS_ENDPOINT_URL, fake credentials) until the session ends."""
    from tests.helpers.s3server import S3Server

    server = S3Server().start()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env().items():
            mp.setenv(key, value)
        yield server
    server.stop()


# Where the suite's time goes: DSRECIPES_TEST_PROFILE=FILE appends one JSON line per test (setup, call and teardown
# together): wall seconds, CPU seconds of this worker and of the children it reaped meanwhile. The cores' share of a
# test is cpu / wall; a test with a long wall and little CPU is waiting (a grace, a timeout), one with CPU near its
# wall keeps a core busy. Off unless set.
_PROFILE = os.environ.get("DSRECIPES_TEST_PROFILE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _PROFILE:
        yield
        return
    import json
    import resource
    import time

    def cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    start = (time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN))
    yield
    wall = time.monotonic() - start[0]
    row = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""), "wall": round(wall, 2),
           "self": round(cpu(resource.RUSAGE_SELF) - start[1], 2),
           "children": round(cpu(resource.RUSAGE_CHILDREN) - start[2], 2), "end": round(time.time(), 1)}
    with open(_PROFILE, "a") as out:
        out.write(json.dumps(row) + "\n")
