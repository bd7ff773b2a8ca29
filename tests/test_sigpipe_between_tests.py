"""A test that changes SIGPIPE's disposition in the pytest process does not hand it to the next test (tests/conftest.py).

Until 3eac241, `dsrecipes.cli.main` set SIGPIPE to SIG_DFL, and tests call `main` in the pytest process: every later
test of that pytest-xdist worker ran with it, and a write to a pipe whose reader had died ended the worker itself.
Seen once in six full runs: "[gw1] node down: Not properly terminated" during test_liveness_prepare_workers.py's
killed preparation worker (its pool sent the dead worker a chunk: write = -1 EPIPE, then the worker killed by
SIGPIPE under strace). Reproduced with test_crash_line's `main` call, then that test, in one xdist worker: 10 worker
deaths in 40 runs, 0 in 40 with this conftest. The product side (main keeps SIGPIPE ignored) is
tests/test_closed_output.py's."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, subprocess_env

INNER_TESTS = '''
import signal


def test_1_leaves_sigpipe_at_sig_dfl():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as cli.main did, or any code a test runs in-process


def test_2_starts_with_sigpipe_as_the_interpreter_set_it():
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
'''


def test_a_test_after_one_that_set_sigpipe_to_sig_dfl_has_it_ignored_again(tmp_path):
    """A pytest session with the suite's conftest: one test sets SIGPIPE to SIG_DFL, the next finds it ignored
    (was: SIG_DFL, and a write to a dead reader killed the pytest worker)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    env = subprocess_env({"PYTHONPATH": str(REPO), "PYTEST_XDIST_WORKER": None, "PYTEST_CURRENT_TEST": None,
                          "PYTEST_ADDOPTS": None})
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout + done.stderr
