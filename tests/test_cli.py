"""The command line through real subprocesses, from a foreign working directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env


def dsr(*args, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", "dsrecipes", *args], capture_output=True, text=True, cwd=cwd,
                          env=subprocess_env(), timeout=timeout)


@pytest.mark.slow
def test_validate_all_from_a_foreign_directory(tmp_path):
    out = dsr("validate", "--all", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("validated ") and " 0 failures" in first
    assert int(first.split()[1]) > 100


def test_validate_never_imports_torch(tmp_path):
    code = ("import sys; from dsrecipes.cli import main; rc = main(['validate', 'zero=stage3', 'precision=fp16']); "
            "assert 'torch' not in sys.modules, 'validate imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK: data=map")


def test_cfg_job_prints_the_composition(tmp_path):
    out = dsr("--cfg", "job", "zero=stage2", "data=iterable", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "stage: 2" in out.stdout and "kind: iterable" in out.stdout
    assert not (tmp_path / "outputs").exists()


def test_show_prints_config_and_deepspeed_json(tmp_path):
    out = dsr("show", "zero=stage3", "--world-size", "8", "--json-only", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ds = json.loads(out.stdout)
    assert ds["train_batch_size"] == 8 * 8 and ds["zero_optimization"]["stage"] == 3
    out = dsr("show", cwd=tmp_path)
    assert "# resolved config" in out.stdout and "micro_batch_size: 8" in out.stdout


def test_ls_lists_groups_options_and_recipes(tmp_path):
    out = dsr("ls", cwd=tmp_path)
    assert out.returncode == 0
    for word in ("zero:", "stage3", "offload:", "cpu_optimizer_params", "recipes", "sharegpt_lora_llama3_8b_zero3"):
        assert word in out.stdout


@pytest.mark.parametrize("args,needle", [
    (["trainer.micro_batchsize=2"], "Key 'micro_batchsize' not in 'TrainerConfig'"),
    (["+trainer.typo=1"], "trainer.typo: unknown key"),
    (["zero=stage2", "offload=cpu_optimizer_params"], "offload.param: parameter offload (cpu) needs ZeRO-3"),
    (["validate", "data.kind=foo"], "Invalid value 'foo'"),
    (["show", "zero=stage9"], "Could not find 'zero/stage9'"),
])
def test_mistakes_exit_2_with_one_message_and_no_traceback(tmp_path, args, needle):
    out = dsr(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr and out.stderr.startswith("error: ")
    assert not (tmp_path / "outputs").exists()


def test_console_script_matches_module(tmp_path):
    exe = Path(sys.executable).parent / "dsrecipes"
    if not exe.exists():
        pytest.skip("console script not installed next to this interpreter")
    a = subprocess.run([str(exe), "validate"], capture_output=True, text=True, cwd=tmp_path, env=subprocess_env())
    b = dsr("validate", cwd=tmp_path)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout
