"""A command whose reader goes away, and a pipe of our own whose reader died, with SIGPIPE ignored (Python's default,
which cli.main keeps; core/console.py OutputClosed).

`dsrecipes ls | head` ends quietly with 141 (the status SIGPIPE gives, as Unix tools end), stdout and stderr alike;
a full stdout is still one message (tests/test_messages_terminal.py). Was: cli.main set SIGPIPE to SIG_DFL for the
whole process, so a write to any pipe whose reader had died killed the launching process without a word: a
preparation worker the OOM killer ended with a task queued for it (core/worker_pool.py, data.preprocess_workers > 1,
`validate --all`) took the launch down with exit 141 instead of naming the worker.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, subprocess_env

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGPIPE"), reason="POSIX pipes")


F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux


def _closed_early(stderr: int) -> subprocess.CompletedProcess:
    """`dsrecipes ls` whose stdout reader reads a little, then goes away (`| head -c 10`). The pipe holds one page
    (F_SETPIPE_SZ), less than `ls` writes (~19 KB): with the default 64 KiB the command could write everything before
    the reader went away and end 0 (seen once in CI under load)."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, F_SETPIPE_SZ, 4096)
    with open(read_end, "rb", buffering=0) as reader:
        proc = subprocess.Popen([sys.executable, "-m", "dsrecipes", "ls"], stdout=write_end, stderr=stderr,
                                cwd=REPO, env=subprocess_env())
        os.close(write_end)
        reader.read(10)
    err = proc.stderr.read() if proc.stderr else b""
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=120), b"", err)


def test_a_reader_that_goes_away_ends_the_command_quietly_with_141():
    done = _closed_early(subprocess.PIPE)
    assert done.returncode == 141 and done.stderr == b"", done


def test_stdout_and_stderr_on_one_closed_pipe_end_it_quietly_too():
    done = _closed_early(subprocess.STDOUT)  # `dsrecipes ls 2>&1 | head`
    assert done.returncode == 141


def test_the_cli_leaves_sigpipe_ignored():
    from dsrecipes.cli import main

    before = signal.getsignal(signal.SIGPIPE)
    assert main(["--version"]) == 0
    assert signal.getsignal(signal.SIGPIPE) == before == signal.SIG_IGN


POOL_AFTER_THE_CLI = textwrap.dedent('''
    import os
    import signal

    from dsrecipes.cli import main
    from dsrecipes.core.worker_pool import WorkerLost, WorkerPool

    main(["--version"])


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


def test_a_pool_in_a_cli_process_names_a_worker_killed_before_its_next_task():
    """As in `dsrecipes train` with data.preprocess_workers > 1: a worker killed with a task queued for it is one
    WorkerLost naming it (5 runs: it was deterministic), not the launching process killed by SIGPIPE (exit 141)."""
    for _ in range(5):
        done = subprocess.run([sys.executable, "-c", POOL_AFTER_THE_CLI], cwd=REPO,
                              env=subprocess_env({"PYTHONPATH": str(REPO)}), capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"exit {done.returncode}: {done.stdout}{done.stderr}"
        assert "lost: pid " in done.stdout and "killed by SIGKILL" in done.stdout, done.stdout + done.stderr
