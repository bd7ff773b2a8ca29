"""SIGPIPE as `dsrecipes.cli.main` leaves it (SIG_DFL: `dsrecipes ls | head` ends quietly).

In the pytest process: tests call `main` in-process, and the disposition it set outlived them, so a later test's
write to a pipe whose reader had died ended the pytest worker itself. Seen once in six full runs: xdist's "[gw1] node
down: Not properly terminated" during test_liveness_prepare_workers.py's killed preparation worker (the pool still
sent that worker a chunk: write = -1 EPIPE, then the worker killed by SIGPIPE under strace); reproduced by
test_crash_line's `main` call, then that test, in one xdist worker: 2 worker deaths in 20 (0 in 20 without it).
tests/conftest.py now gives every test the disposition the process started with.

In a real `dsrecipes` process, `main` has set it for the whole run: the pool of the data preparation (and of
`validate --all`) writing to a worker the OOM killer has just ended dies of SIGPIPE, with no message, instead of
the one message that names the worker (dsrecipes/core/worker_pool.py, not fixed here: the xfail below)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, subprocess_env

INNER_TESTS = '''
import signal


def test_1_calls_the_cli_in_this_process(capsys):
    from dsrecipes.cli import main

    assert main(["--version"]) == 0
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL  # what the CLI leaves


def test_2_starts_with_sigpipe_as_the_interpreter_set_it():
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
'''


def _inner_env() -> dict:
    return subprocess_env({"PYTHONPATH": str(REPO), "PYTEST_XDIST_WORKER": None, "PYTEST_CURRENT_TEST": None,
                           "PYTEST_ADDOPTS": None})


def test_a_test_after_one_that_ran_the_cli_in_process_has_sigpipe_ignored_again(tmp_path):
    """A pytest session with the suite's conftest: one test runs `main` in-process, the next one finds SIGPIPE
    ignored again (was: SIG_DFL, and a write to a dead reader killed the pytest worker)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "test_inner.py"], cwd=tmp_path, env=_inner_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr


POOL_AFTER_THE_CLI = textwrap.dedent('''
    import os
    import signal

    from dsrecipes.cli import main
    from dsrecipes.core.worker_pool import WorkerLost, WorkerPool

    main(["--version"])
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL, "the CLI no longer sets SIGPIPE: see this test"


    def dies(task):
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, in the worker


    pool = WorkerPool(1, dies, label="test", name="worker", waiting=lambda *a: "", line_s=30.0, bound_s=60.0,
                      reap_s=5.0)
    try:
        pool.submit("first")
        pid = pool.workers[0].proc.pid
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead (not reaped): its end of the task pipe is closed
        try:
            pool.submit("second")  # before the pool has read the end of its answers pipe
            pool.next()
        except WorkerLost as lost:
            print("lost:", lost.how(), flush=True)
    finally:
        pool.close()
''')


@pytest.mark.xfail(strict=True, reason="dsrecipes/core/worker_pool.py writes to its workers' pipes with SIGPIPE at "
                                       "SIG_DFL (set by cli.main): a task sent to a worker that just died kills the "
                                       "launching process by SIGPIPE; not this file's owner's to fix")
def test_the_pool_of_a_cli_process_names_a_worker_killed_before_its_next_task():
    """As in `dsrecipes train` with data.preprocess_workers > 1 (the CLI's SIGPIPE): a worker killed with a task
    queued for it is one WorkerLost naming it, not the launching process killed by SIGPIPE without a word."""
    done = subprocess.run([sys.executable, "-c", POOL_AFTER_THE_CLI], cwd=REPO, env=_inner_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stdout}{done.stderr}"
    assert "lost: pid " in done.stdout and "killed by SIGKILL" in done.stdout, done.stdout + done.stderr
