"""Failures said once, tried for real first (helper pipecrash): a pipeline stage that crashes (an exception that is
no refusal) is one message naming the stage, the cause and where its traceback was kept, never a traceback on the
console."""

from __future__ import annotations

import sys

import pytest


@pytest.mark.parametrize("where", ["run", "check_machine"])  # inside Hydra's job (run dir claimed), before the claim
def test_a_stage_that_crashes_is_one_message_with_its_traceback_in_the_log(tmp_path, monkeypatch, capsys, where):
    """Tried for real (`dsrecipes pipeline p.yaml --out out`, the launch of the first stage raising RuntimeError as a
    bug or torch would): Hydra's 'Error executing job with overrides: [...]' and the whole traceback on the console
    (commands/pipeline.train_stage printed it), then 'error: pipeline: stage 'sft' (1 of 2) failed (exit 1); its run
    directory: ...' without the cause. Now one line: the cause as 'RuntimeError: ... (at file:line)', where its
    traceback is (the stage's logs/main.log; the pipeline's logs/pipeline.log where the stage made no run directory)
    and the pipeline's resume command; exit 2."""
    import dsrecipes.commands.train as train
    from dsrecipes.cli import main

    def crash(*args):
        raise RuntimeError("the launch broke")

    monkeypatch.setattr(train, where, crash)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text("shared: {debug: fast}\nstages:\n  - name: sft\n  - name: b\n    model_from: sft\n")
    code = main(["pipeline", "p.yaml", "--out", "out"])
    out, err = capsys.readouterr()
    log = tmp_path / "out" / ("sft/logs/main.log" if where == "run" else "logs/pipeline.log")
    command = f"cd {tmp_path} && {sys.executable} -m dsrecipes pipeline p.yaml --out out"
    assert code == 2 and "Traceback" not in out + err and "Error executing job" not in err, (out, err)
    assert err.count("error:") == 1 and err.count("RuntimeError") == 1, err
    err = err.splitlines()[-1]
    assert err.startswith("error: pipeline: stage 'sft' (1 of 2) failed (exit 1): RuntimeError: the launch broke (at "
                          "tests/test_redteam_live4.py:"), err
    assert f"(full traceback: out/{log.relative_to(tmp_path / 'out')}); " in err, err
    assert err.rstrip().endswith(f"resume with: {command}"), err
    assert "RuntimeError: the launch broke" in log.read_text() and "Traceback" in log.read_text()
    assert (tmp_path / "out" / "sft").is_dir() == (where == "run") and not (tmp_path / "out" / "b").exists()


def test_a_pipeline_files_outside_options_are_refused_naming_where_each_key_was_set(tmp_path):
    """Tried for real: a pipeline file whose `launcher.extra_args` resolves to `--local_addr=HOST` (through
    `${trainer.experiment}`, text naming no option), whose `dataset.paths` and registry read a foreign bucket. Was
    'launcher.extra_args[0]: --local_addr names a host outside this machine; a pipeline file is shared like a recipe:
    name it on your command line' (a pipeline takes no overrides: no command line to name it on) and 's3://b/...
    named by a pipeline file': neither said where the key was set, unlike config/safety.py's 'set by FILE:LINE, a
    shared recipe; ...'. Now the same words as safety's, with the line of the pipeline file's setting."""
    from dsrecipes.config.pipeline_file import load_pipeline
    from dsrecipes.core.errors import UserError
    from dsrecipes.run.pipeline import check_stages

    registry = tmp_path / "dataset_info.json"
    registry.write_text('{"theirs": {"file_name": "s3://their-bucket/rows.jsonl"}}', encoding="utf-8")
    path = tmp_path / "p.yaml"
    path.write_text("shared:\n  launcher: torchrun\n  trainer.experiment: --local_addr=evil.example\nstages:\n"
                    "  - name: a\n    set:\n      launcher.extra_args: ['${trainer.experiment}']\n"
                    "      dataset.paths: [s3://their-bucket/x.jsonl]\n"
                    f"  - name: b\n    set:\n      dataset.registry: {registry}\n      dataset.use: [theirs]\n",
                    encoding="utf-8")
    with pytest.raises(UserError) as err:
        check_stages(load_pipeline(path), tmp_path / "out")
    shared = "a pipeline file (shared like a recipe)"
    signs = ("reading it would sign requests to that bucket with your AWS credentials (its owner's logs see your "
             "access key id), so allow the bucket: DSRECIPES_S3_BUCKETS=their-bucket")
    assert err.value.problems == [
        f"{path}: stage 'a' (line 5): launcher.extra_args[0]: --local_addr set by {path}:7, {shared}; it names a "
        "host outside this machine, so only your command line may name it, and a pipeline takes no overrides: run "
        "this stage with `dsrecipes train` and give launcher.extra_args=[...] on its command line",
        f"{path}: stage 'a' (line 5): dataset.paths: s3://their-bucket/... set by {path}:8, {shared}; {signs}",
        f"{path}: stage 'b' (line 9): dataset.registry: entry 'theirs' reads s3://their-bucket/... (registry "
        f"{registry}, set by {path}:11, {shared}); {signs}"], err.value.problems
    assert not (tmp_path / "out").exists()


SURVIVOR = """\
import sys, time
from datetime import timedelta
import torch.distributed as dist
host = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)  # rank 0's store
beat = dist.TCPStore("127.0.0.1", host.port, None, False, timedelta(seconds=5), wait_for_workers=False)
beat.add("beat", 1)
del host  # rank 0 ended (its failure said by then)
time.sleep(0.2)
try:
    beat.add("beat", 1)  # the surviving rank's next beat
except Exception as exc:
    print(f"store gone: {type(exc).__name__}", file=sys.stderr)
"""


def test_a_surviving_rank_meeting_the_store_of_a_rank_that_ended_prints_no_cpp_warning(tmp_path, monkeypatch,
                                                                                      capsys):
    """Tried for real (2 ranks, launcher=deepspeed on CPU, rank 0 raising in rank/session.check_loader): after
    'error: rank 0 failed: RuntimeError: ...', rank 1 printed torch's '[rank1]:[W... TCPStore.cpp:125] [c10d]
    recvValue failed on SocketImpl(...): Connection reset by peer', 'Exception raised from recvBytes ...' and ~20
    'frame #N' lines (its heartbeat's next beat met the store rank 0 hosted). Here the same store call in a process
    started as the launchers start ranks (run/launch/process.run_subprocess, output relayed): torch's C++ warning
    stays off the console (boundary/rank_env.RANK_DEFAULTS: TORCH_CPP_LOG_LEVEL=ERROR), the process's own lines
    show; a level the user set is theirs."""
    from dsrecipes.boundary.rank_env import rank_defaults
    from dsrecipes.run.launch.plan import Command
    from dsrecipes.run.launch.process import run_subprocess

    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    (tmp_path / "rank.py").write_text(SURVIVOR, encoding="utf-8")
    code = run_subprocess(Command([sys.executable, str(tmp_path / "rank.py")], {}), tmp_path, grace_s=5,
                          log=tmp_path / "launcher.log", announce=False)
    out, err = capsys.readouterr()
    assert code == 0 and "store gone: DistNetworkError" in err, (out, err)
    assert "TCPStore" not in out + err and "frame #" not in out + err, (out, err)
    assert rank_defaults({"TORCH_CPP_LOG_LEVEL": "INFO"}) == {}


AGENT_OUTPUT = """\
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being \
overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
step 2/4  loss 7.4667  lr 3.00e-03
W1206 18:48:56.624000 11467 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process \
11551 closing signal SIGTERM
E1206 18:48:56.739000 11467 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: \
1) local_rank: 0 (pid: 11550) of binary: /usr/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \x20
============================================================
dsrecipes.rank.worker FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 11550)
============================================================
Traceback (most recent call last):
  File "x.py", line 1, in <module>
ValueError: another process's own
"""


def test_torchruns_agent_says_nothing_on_the_console_after_a_rank_failed(tmp_path):
    """Tried for real (2 ranks, launcher=torchrun on CPU, rank 0 raising after step 2): before 'error: rank 0 failed:
    RuntimeError: ...', the console showed torchrun's banner, its agent's 'W... Sending process ... closing signal
    SIGTERM' and 'E... failed (exitcode: 1) local_rank: 0 ...' lines, its uncaught 'Traceback ... ChildFailedError'
    (14 lines) and the '====' box of exit codes (20 lines). Now core/console.relay keeps them in the log; another
    traceback still shows, whole."""
    import io
    import os

    from dsrecipes.core.console import relay

    read, write = os.pipe()
    console, log = io.StringIO(), tmp_path / "launcher.log"
    with os.fdopen(read, "rb") as stream:
        thread = relay(stream, console, log)
        os.write(write, AGENT_OUTPUT.encode())
        os.close(write)
        thread.join(10)
    assert console.getvalue() == ("step 2/4  loss 7.4667  lr 3.00e-03\nTraceback (most recent call last):\n"
                                  '  File "x.py", line 1, in <module>\nValueError: another process\'s own\n')
    kept = log.read_text()
    assert "ChildFailedError" in kept and "Root Cause" in kept and "closing signal SIGTERM" in kept
