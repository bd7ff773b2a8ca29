"""Installable anywhere: a wheel built from the checkout carries conf/ and recipes/, and a fresh virtual environment
with only that wheel runs dsrecipes from an unrelated directory (no checkout, no DSRECIPES_HOME, no PYTHONPATH).

The venv sees the machine's site-packages (torch, deepspeed, ... are not downloaded again); the wheel is installed
with --no-deps --no-index, so nothing comes from the network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsrecipes.config.groups import group_options
from tests.conftest import REPO, subprocess_env

pytestmark = pytest.mark.slow
IGNORED = (".git", "outputs", "multirun", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "bench_out",
           ".venv", ".whl", "wandb", "mlruns")


def _run(argv, cwd, env, timeout=600):
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_wheel_installs_into_a_fresh_venv_and_runs_from_anywhere(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and *.egg-info behind
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(*IGNORED))
    env = {k: v for k, v in subprocess_env().items() if k not in ("PYTHONPATH", "DSRECIPES_HOME", "DSRECIPES_RECIPES")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
          src], cwd=tmp_path, env=env)
    (wheel,) = (tmp_path / "dist").glob("dsrecipes-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"dsrecipes/conf/{g}/{o}.yaml" for g, opts in group_options().items() for o in opts}
    assert "dsrecipes/conf/train.yaml" in names and shipped <= names, sorted(shipped - names)
    assert "dsrecipes/conf/recipe/cpu_zero2_two_ranks.yaml" in names  # recipes/ through the conf/recipe link

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv], cwd=tmp_path, env=env)
    py, exe = venv / "bin" / "python", venv / "bin" / "dsrecipes"
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], cwd=tmp_path, env=env)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    version = _run([exe, "--version"], cwd=elsewhere, env=env)
    assert f"({venv}" in version.splitlines()[0], version  # the installed copy, not the checkout
    assert _run([exe, "validate"], cwd=elsewhere, env=env).startswith("OK: data=map")
    assert str(venv) in _run([exe, "ls", "recipe"], cwd=elsewhere, env=env)
    # (the default 10 warmup steps are clamped to the 5-step run with a note: `trainer.max_steps=5` alone is the command)
    done = subprocess.run([py, "-m", "dsrecipes", "trainer.max_steps=5"], cwd=elsewhere,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (run_dir,) = [p for p in (elsewhere / "outputs").glob("*/*") if p.is_dir()]
    assert (run_dir / "export" / "model.safetensors").is_file()
    _check_console(done.stdout, done.stderr, run_dir)


def _check_console(out: str, err: str, run: Path) -> None:
    """What a new user sees, output not on a terminal: plain lines, no third-party noise, a closing summary."""
    shown = out + err
    assert "\r" not in shown and "Setting accelerator" not in shown and "Attempting to get" not in shown
    assert "Writing model shards" not in shown
    assert "step 5/5  loss " in out and "step 5/5  eval_loss " in out
    summary = out[out.index("done: 5 steps in "):]
    result = json.loads((run / "result.json").read_text())
    assert f"-> {result['final_eval_loss']:.4f}" in summary.splitlines()[2]
    assert f"  run dir      {run}\n" in summary and f"  model        {run / 'export'}" in summary
    assert f"dsrecipes prompt-eval --baseline {run} --finetuned {run}" in summary
    assert f"train further: dsrecipes trainer.output_dir={run} trainer.max_steps=10" in summary
    assert "Setting accelerator to CPU" in (run / "logs" / "main.log").read_text()
