"""No third-party progress bar or banner reaches the console (issue 22 item 5): `train` (with W&B in offline mode),
`export`, `chat` and `prompt-eval`, each run under a pseudo-terminal (where progress bars draw and libraries print
banners) and the screen read back. What is kept off the screen is in the run's logs.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

import pytest

from tests.conftest import subprocess_env

pytestmark = pytest.mark.slow

NOISE = [
    "Loading weights", "Writing model shards", "Loading checkpoint shards", "Setting accelerator to CPU",
    "wandb:", "W&B", "Tracking run", "View run", "Syncing run",
]


def on_screen(argv: List[str], cwd: Path, env: dict, timeout: float = 600) -> Tuple[int, str]:
    """Run `argv` with stdin/stdout/stderr on a pseudo-terminal; (exit code, everything it drew)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(argv, cwd=cwd, env={**env, "COLUMNS": "120", "TERM": "xterm"}, stdin=slave,
                            stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    poller = select.poll()  # not select(): a long-lived test process may hold descriptors past FD_SETSIZE (1024)
    poller.register(master, select.POLLIN)
    while time.monotonic() < deadline:
        ready = poller.poll(500)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None and not chunks[-1:]:
            break
    os.close(master)
    code = proc.wait(timeout=60)
    return code, b"".join(chunks).decode("utf-8", "replace")


def third_party_on(screen: str) -> List[str]:
    """Pieces of the screen (split at newlines and carriage returns) that are third-party noise: a known banner or
    warning, or a progress bar that is not the run's own `train` bar."""
    pieces = [p.strip() for p in re.split(r"[\r\n]+", screen) if p.strip()]
    found = [p for p in pieces if any(n in p for n in NOISE)]
    bars = [p for p in pieces if re.search(r"\d+%\|", p) and not p.startswith("train")]
    return found + bars


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quiet")


@pytest.fixture(scope="module")
def trained(ws) -> Tuple[Path, str]:
    from tests.test_train_runs import SHORT

    run = ws / "run"
    env = subprocess_env({"WANDB_MODE": "offline", "WANDB_DIR": str(ws)})
    code, screen = on_screen([sys.executable, "-m", "dsrecipes", *SHORT, "trainer.max_steps=2",
                              "trainer.report_to=[tensorboard,wandb]", f"data.cache_dir={ws / 'cache'}",
                              f"trainer.output_dir={run}"], ws, env)
    assert code == 0, screen[-4000:]
    return run, screen


def test_train_shows_its_own_lines_and_bar_only(trained):
    run, screen = trained
    assert third_party_on(screen) == [], screen[-4000:]
    assert "done: 2 steps" in screen and re.search(r"train:\s+\d+%\|", screen)  # our own bar is drawn
    assert list((run / "wandb").glob("offline-run-*"))  # W&B did run (offline), silently


def test_export_chat_and_prompt_eval_draw_no_third_party_bar_or_warning(ws, trained):
    run, _ = trained
    env = subprocess_env()
    commands = {
        "export": ["export", str(run), "--out", str(ws / "exported")],
        "chat": ["chat", str(run), "--message", "Hello", "--max-new-tokens", "4"],
        "prompt-eval": ["prompt-eval", "--finetuned", str(run), "--limit", "2", "--max-new-tokens", "4"],
    }
    for name, args in commands.items():
        code, screen = on_screen([sys.executable, "-m", "dsrecipes", *args], ws, env)
        assert code == 0, f"{name}: {screen[-4000:]}"
        assert third_party_on(screen) == [], f"{name}: {screen[-4000:]}"
    logged = "\n".join(p.read_text() for p in (run / "logs").glob("*.log"))
    assert "Setting accelerator to CPU" in logged  # kept in the run's logs, not lost
