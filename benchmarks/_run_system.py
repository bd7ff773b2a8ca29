"""How benchmarks/gpu_compare.py runs one system's command (not a benchmark itself).

Owner: benchmarks/. `run_child(argv, log, ...)`: in its own process (the GPU run: a system as its user starts it,
with a bound and nvidia-smi's peak memory polled meanwhile), or, for the CPU dry run (`--smoke` without a GPU), the
same command's entry point called in this process: `python -m dsrecipes ...` is `dsrecipes.cli.main(...)`,
`[deepspeed ...] python SCRIPT.py ...` is SCRIPT's `main(...)`. Same arguments either way, so a renamed option or
function fails the dry run. The one-rank process group an in-process run joins stays up for the next one (DeepSpeed
caches its groups), the environment is restored, the HF Trainer's accelerate state is dropped.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]


class MemPoll:
    """The largest nvidia-smi memory.used (GiB) while a child runs (None without a GPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.peak, self.stop = cuda, None, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.wait(0.5):
            got = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            if got:
                self.peak = max(self.peak or 0.0, float(got[0]) / 1024)

    def __enter__(self) -> "MemPoll":
        if self.cuda:
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()


def run_child(argv: List[str], log: Path, *, in_process: bool, cuda: bool, timeout_s: float,
              env: Optional[Dict[str, str]] = None):
    """(exit code or 'timeout', peak GiB, wall seconds) of one system's command: its own process, or (the CPU dry
    run) the same command's entry point called in this process."""
    t0 = time.time()
    if in_process:
        return run_here(argv, log, env), None, time.time() - t0
    with MemPoll(cuda) as mem, open(log, "w") as fh:
        try:
            code = subprocess.run(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return code, mem.peak, time.time() - t0


def run_here(argv: List[str], log: Path, env: Optional[Dict[str, str]]) -> int:
    """`python -m dsrecipes ...` -> dsrecipes.cli.main(...); `[deepspeed ...] python SCRIPT.py ...` -> SCRIPT's
    main(...), in this process with `env` set (output to `log`); the environment is restored afterwards."""
    saved = dict(os.environ)
    os.environ.update({"TOKENIZERS_PARALLELISM": "false", **(env or {})})
    try:
        with open(log, "w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
            try:
                code = _entry(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except Exception:  # noqa: BLE001 - the row records the failure, the log its traceback
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        _reset_distributed()
    return code


def _entry(argv: List[str]) -> int:
    if argv[1:3] == ["-m", "dsrecipes"]:
        from dsrecipes.cli import main

        return main(argv[3:])
    script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    importlib.import_module(Path(argv[script]).stem).main(argv[script + 1:])
    return 0


def _reset_distributed() -> None:
    """The process group stays up (DeepSpeed caches its groups and cannot rebuild them after a destroy: the next
    in-process run joins the same one-rank group); the HF Trainer's accelerate state goes."""
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:  # the HF Trainer's process state would outlive its run
        accelerate_state.AcceleratorState._reset_state(True)


def rank_env() -> Dict[str, str]:
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
