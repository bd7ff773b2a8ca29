"""A full disk is a message (issue 21 item 5), on a real filesystem that fills up: a tmpfs sized so that the run's
first checkpoint fits and the second does not. The run fails with one message naming the checkpoint and the bytes
it needs, result.json says failed with that reason, the partial directory is gone, the first checkpoint verifies,
and once there is space the same command resumes from it and finishes. An export into a full filesystem is one
message (exit 2) and leaves nothing there. Needs `mount -t tmpfs` (root); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.test_run_ownership import dsrecipes
from tests.test_run_safety import train, ws  # noqa: F401  (ws: the module-scoped workspace fixture)

pytestmark = pytest.mark.slow


def mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root")


@pytest.fixture
def small_disk(tmp_path):
    mounted = []

    def make(name: str, size: str) -> Path:
        where = tmp_path / name
        mount_tmpfs(where, size)
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def test_a_checkpoint_that_does_not_fit_fails_cleanly_and_resumes_later(ws, small_disk):  # noqa: F811
    from dsrecipes.boundary.checkpoint_find import damage

    disk = small_disk("disk", "13M")  # export_init (2.7 MB) + step_4 (7.7 MB) fit; step_8 does not
    run = disk / "run"
    code, out = train(ws, run)
    assert code == 1, out[-3000:]
    message = f"checkpoint: out of disk space writing {run}/checkpoints/step_8: it needs about "
    assert message in out and "Traceback" not in out, out[-3000:]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "failed" and result["error"].startswith(message)
    assert f"{run}/checkpoints/step_4 is intact" in result["error"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_4"]  # no .partial
    assert damage(run / "checkpoints" / "step_4") is None

    subprocess.run(["mount", "-o", "remount,size=64M", str(disk)], check=True)  # space freed
    code, out = train(ws, run)
    assert code == 0 and f"resumed from {run}/checkpoints/step_4" in out, out[-3000:]
    assert json.loads((run / "result.json").read_text())["status"] == "ok"
    assert damage(run / "checkpoints" / "step_8") is None and (run / "export" / "model.safetensors").is_file()

    full = small_disk("full", "1M")
    code, out = dsrecipes("export", str(run), "--out", str(full / "out"), cwd=full)
    assert code == 2 and f"--out: out of disk space writing {full / 'out'}: it needs at least " in out, out[-2000:]
    assert "Traceback" not in out and list(full.iterdir()) == []
