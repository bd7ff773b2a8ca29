"""Console output: progress lines off a terminal, third-party noise kept in <run>/logs/, the closing summary."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsrecipes.core import console
from dsrecipes.observe.metrics import MetricsLogger, format_seconds
from tests.conftest import subprocess_env

NOISE = [
    "[2026-11-30 09:41:49,700] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU. If you "
    "have GPU or other accelerator, we were unable to detect it.",
    "[2026-11-30 09:41:56,486] [WARNING] [runner.py:214:fetch_hostfile] Unable to find hostfile, will proceed with "
    "training with local resources only.",
    "[2026-11-30 09:41:59,773] [INFO] [launch.py:152:main] WORLD INFO DICT: {'localhost': [0, 1]}",
    "node1: [2026-11-30 09:41:56,494] [INFO] [runner.py:618:main] cmd = /usr/bin/python -u -m deepspeed.launcher",
    "[2026-11-30 09:42:33,886] [WARNING] [lr_schedules.py:938:get_lr] Attempting to get learning rate from scheduler "
    "before it has started",
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
    "/x/torch/distributed/c10d_logger.py:83: FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated.",
    "  return func(*args, **kwargs)",
    "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 22.00it/s]",
    # a failed rank's exit code, from DeepSpeed's launcher: commands/outcome.conclude always says why in words
    # (the rank's reason, "rank 1 was killed by SIGKILL", or "the ranks exited with code N without a report")
    "[2026-11-30 09:42:45,290] [ERROR] [launch.py:325:sigkill_handler] exits with return code = 1",
]
KEPT = ["step  10/400  loss 7.1897  lr 2.40e-03", "error: data/x.jsonl:3: not valid JSON",
        "[2026-11-30 09:42:45,290] [ERROR] [engine.py:12:step] any other error DeepSpeed reports",
        "model tiny: 639,744 parameters", "train:  50%|█████     | 4/8 [00:01<00:00,  4.68step/s, loss=7.4834]"]


@pytest.mark.parametrize("line", NOISE)
def test_noise_is_recognised(line):
    assert console.is_noise(line)


@pytest.mark.parametrize("line", KEPT)
def test_what_the_user_needs_is_kept(line):
    assert not console.is_noise(line)


def test_relay_passes_lines_and_bars_and_keeps_noise_in_the_log(tmp_path):
    script = ("import sys, time\n"
              f"print({NOISE[0]!r}, flush=True)\n"
              "print('model tiny: 1 parameter', flush=True)\n"
              "for i in range(3):\n"
              "    sys.stderr.write(f'\\rtrain: {i}/3'); sys.stderr.flush(); time.sleep(0.05)\n"
              "sys.stderr.write('\\n')\n"
              f"print({NOISE[2]!r})\n"
              "sys.stdout.write('no newline at the end')\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err, log = io.StringIO(), io.StringIO(), tmp_path / "logs" / "main.log"
    threads = [console.relay(proc.stdout, out, log), console.relay(proc.stderr, err, log)]
    assert proc.wait(timeout=60) == 0
    for t in threads:
        t.join(timeout=10)
    assert out.getvalue() == "model tiny: 1 parameter\nno newline at the end"
    assert err.getvalue() == "\rtrain: 0/3\rtrain: 1/3\rtrain: 2/3\n"
    assert log.read_text().splitlines() == [NOISE[0], NOISE[2]]


def test_own_processes_keep_deepspeed_and_python_warnings_off_the_console(tmp_path):
    """A real deepspeed import and scheduler call in a fresh process: the console stays clean, the log keeps all."""
    log = tmp_path / "logs" / "rank0.log"
    code = textwrap.dedent(f"""
        import warnings
        from dsrecipes.core.console import quiet_third_party
        quiet_third_party({str(log)!r})
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.utils import logger
        get_accelerator()
        logger.warning("Attempting to get learning rate from scheduler before it has started")
        logger.warning("a warning the user should see")
        warnings.warn("`foo` is deprecated", FutureWarning)
        warnings.warn("more DataLoader workers than cores", UserWarning)
        print("ours")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=subprocess_env({"PYTHONPATH": str(Path(__file__).resolve().parents[1])}))
    assert done.returncode == 0, done.stderr
    shown = done.stdout + done.stderr
    assert "ours" in shown and "a warning the user should see" in shown and "more DataLoader workers" in shown
    for hidden in ("Setting accelerator", "Attempting to get learning rate", "deprecated"):
        assert hidden not in shown, shown
    kept = log.read_text()
    assert "Attempting to get learning rate" in kept and "a warning the user should see" not in kept
    assert "FutureWarning: `foo` is deprecated" in kept


def test_progress_mode(monkeypatch):
    monkeypatch.setenv(console.PROGRESS_ENV, "bar")
    assert console.progress_mode() == "bar"
    monkeypatch.setenv(console.PROGRESS_ENV, "lines")
    assert console.progress_mode() == "lines"
    monkeypatch.delenv(console.PROGRESS_ENV)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    assert console.progress_mode() == "lines"


def test_lines_mode_prints_one_plain_line_per_log_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(console.PROGRESS_ENV, "lines")
    log = MetricsLogger(tmp_path, rank=0, total_steps=400, cfg=None)
    for step in (10, 20):
        log.step(10)
        log.log_train(step=step, loss=5.0, lr=3e-3, grad_norm=1.5, tokens_per_s=1234.5, samples_seen=8, elapsed=1.0)
    log.log_eval(20, 4.5)
    log.close()
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("step  10/400  loss 5.0000  lr 3.00e-03  grad_norm 1.500  1,234 tok/s  elapsed ")
    assert lines[2] == "step  20/400  eval_loss 4.5000" and len(lines) == 3
    assert "\r" not in captured.out + captured.err


def test_format_seconds():
    assert [format_seconds(s) for s in (4.4, 65, 3725)] == ["4s", "1m05s", "1h02m"]


def test_bar_mode_draws_a_bar(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(console.PROGRESS_ENV, "bar")
    log = MetricsLogger(tmp_path, rank=0, total_steps=4, cfg=None)
    for step in (1, 2, 3, 4):
        log.step()
        log.log_train(step=step, loss=5.0, lr=3e-3, grad_norm=None, tokens_per_s=10.0, samples_seen=8, elapsed=1.0)
    log.close()
    captured = capsys.readouterr()
    assert "train: 100%" in captured.err and "\r" in captured.err and "step 4/4  loss" not in captured.out


def test_model_commands_log_third_party_noise_into_the_runs_logs(tmp_path):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    assert console.command_log(["chat", str(run), "--message", "hi"], "chat") == run / "logs" / "chat.log"
    assert console.command_log([str(run / "export")], "chat") == run / "logs" / "chat.log"  # an export of a run
    assert console.command_log([f"--finetuned={run}"], "prompt-eval") == run / "logs" / "prompt-eval.log"
    assert console.command_log([str(tmp_path), "--limit", "2"], "export") is None  # not a run: nowhere
