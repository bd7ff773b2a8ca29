"""doctor: every check against faked machines, plus one real run on this machine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dsrecipes.core import jit_ops
from dsrecipes.run import doctor
from dsrecipes.run.doctor import Context, Level
from dsrecipes.run.machine import Probe


class FakeProbe(Probe):
    """A healthy CUDA machine unless a test changes an attribute."""

    def __init__(self, **changes):
        super().__init__(environ={"PATH": "/usr/bin", "HOME": "/home/u"})
        self.versions = {"torch": "2.5.1", "deepspeed": "0.16.0", "transformers": "4.46.0", "hydra-core": "1.3.2",
                         "omegaconf": "2.3.0"}  # fmt: skip
        self.torch_info = {"version": "2.5.1+cu124", "cuda": "12.4", "cuda_available": True, "devices": ["H100"],
                           "nccl": "2.21.5", "bf16": True}  # fmt: skip
        self.binaries = {"c++": "/usr/bin/c++", "ninja": "/usr/bin/ninja", "nvcc": "/usr/local/cuda/bin/nvcc"}
        self.nvcc_text = "Cuda compilation tools, release 12.4, V12.4.131"
        self.accel = "cuda"
        self.paths = {"/usr/local/cuda", "/usr/local/cuda/bin/nvcc", "/usr/include/libaio.h"}
        self.libs = {"aio": "libaio.so.1"}
        self.shm = 16 * doctor.GIB
        self.locks = []
        self.can_write = True
        self.__dict__.update(changes)

    def which(self, name):
        return self.binaries.get(name)

    def run(self, argv):
        return self.nvcc_text

    def version(self, dist):
        return self.versions.get(dist)

    def torch(self):
        return self.torch_info

    def accelerator(self):
        return self.accel

    def shm_bytes(self):
        return self.shm

    def find_library(self, name):
        return self.libs.get(name)

    def exists(self, path):
        return path in self.paths

    def writable(self, path):
        return self.can_write

    def lock_files(self, root):
        return self.locks

    def built_ops(self, root):
        return ["cpu_adam"]


def levels(findings, check):
    return [f.level for f in findings if f.check == check]


def only(findings, check):
    (f,) = [f for f in findings if f.check == check]
    return f


def test_healthy_machine_has_no_problems():
    findings = doctor.diagnose(FakeProbe(), Context())
    assert [f for f in findings if f.level is not Level.ok] == []
    assert "NCCL 2.21.5" in only(findings, "cuda").message


def test_cuda_home_with_a_path_list_is_an_error():
    probe = FakeProbe()
    probe.environ["CUDA_HOME"] = "/usr/local/cuda:/opt/cuda"
    f = only(doctor.diagnose(probe, Context()), "cuda_home")
    assert f.level is Level.error and "path list" in f.message and "one directory" in f.fix


def test_cuda_home_pointing_nowhere_is_an_error():
    probe = FakeProbe()
    probe.environ["CUDA_HOME"] = "/opt/cuda-11.0"
    f = only(doctor.diagnose(probe, Context()), "cuda_home")
    assert f.level is Level.error and "does not exist" in f.message


def test_nvcc_major_mismatch_warns_and_minor_difference_is_fine():
    f = only(doctor.diagnose(FakeProbe(nvcc_text="release 11.8, V11.8.89"), Context()), "nvcc")
    assert f.level is Level.warn and "11.8" in f.message and "12.4" in f.message
    f = only(doctor.diagnose(FakeProbe(nvcc_text="release 12.1, V12.1.0"), Context()), "nvcc")
    assert f.level is Level.ok


def test_no_nvcc_with_cuda_torch_warns():
    probe = FakeProbe(binaries={"c++": "/usr/bin/c++", "ninja": "/usr/bin/ninja"})
    f = only(doctor.diagnose(probe, Context()), "nvcc")
    assert f.level is Level.warn and "torch_adam" in f.fix


def test_missing_compiler_is_an_error_only_when_the_config_jit_builds():
    probe = FakeProbe(binaries={"ninja": "/usr/bin/ninja", "nvcc": "/usr/local/cuda/bin/nvcc"})
    assert levels(doctor.diagnose(probe, Context()), "jit") == [Level.warn]
    f = only(doctor.diagnose(probe, Context(needs_jit=True)), "jit")
    assert f.level is Level.error and "C++ compiler" in f.message and "build-essential" in f.fix


def test_small_shm_with_dataloader_workers_is_an_error():
    probe = FakeProbe(shm=64 * 1024**2)  # docker's default
    assert levels(doctor.diagnose(probe, Context(num_workers=0)), "shm") == [Level.warn]
    f = only(doctor.diagnose(probe, Context(num_workers=4)), "shm")
    assert f.level is Level.error and "--shm-size" in f.fix


def test_stale_extension_lock_is_reported_with_its_path():
    probe = FakeProbe(locks=[("/home/u/.cache/torch_extensions/py311_cu124/cpu_adam/lock", 7200.0), ("/x/new/lock", 5)])
    (f,) = [f for f in doctor.diagnose(probe, Context()) if f.check == "torch_extensions"]
    assert f.level is Level.warn and f.fix.startswith("rm /home/u/.cache/torch_extensions/py311_cu124/cpu_adam/lock")


def test_extensions_dir_env_is_used():
    probe = FakeProbe()
    probe.environ["TORCH_EXTENSIONS_DIR"] = "/scratch/ext"
    assert "/scratch/ext" in only(doctor.diagnose(probe, Context()), "torch_extensions").message


def test_gpu_visible_but_deepspeed_on_cpu_is_an_error():
    probe = FakeProbe(accel="cpu")
    probe.environ["DS_ACCELERATOR"] = "cpu"
    f = only(doctor.diagnose(probe, Context()), "accelerator")
    assert f.level is Level.error and "DS_ACCELERATOR=cpu" in f.message


def test_nvme_offload_needs_libaio():
    probe = FakeProbe(libs={})
    assert levels(doctor.diagnose(probe, Context()), "libaio") == [Level.ok]
    assert levels(doctor.diagnose(probe, Context(needs_aio=True)), "libaio") == [Level.error]


def test_wrong_hydra_and_missing_deepspeed_are_errors():
    probe = FakeProbe()
    probe.versions = {**probe.versions, "hydra-core": "1.4.0"}
    del probe.versions["deepspeed"]
    findings = doctor.diagnose(probe, Context())
    assert only(findings, "hydra-core").level is Level.error
    assert only(findings, "deepspeed").level is Level.error


def test_broken_check_does_not_hide_the_others():
    class Broken(FakeProbe):
        def shm_bytes(self):
            raise RuntimeError("statvfs exploded")

    findings = doctor.diagnose(Broken(), Context())
    assert "statvfs exploded" in only(findings, "shm").message
    assert only(findings, "jit").level is Level.ok


def test_context_from_config(make_cfg):
    ctx = Context.from_config(make_cfg("zero=stage2", "offload=cpu_optimizer", "data.num_workers=3", check_files=False))
    assert ctx.needs_jit and not ctx.needs_aio and ctx.num_workers == 3
    assert not Context.from_config(make_cfg(check_files=False)).needs_jit


def test_doctor_on_this_machine(capsys):
    from dsrecipes.commands.doctor import main

    code = main(["--json"])
    findings = json.loads(capsys.readouterr().out)
    checks = {f["check"] for f in findings}
    assert {"torch", "deepspeed", "accelerator", "shm", "jit", "torch_extensions"} <= checks
    assert code == (1 if any(f["level"] == "error" for f in findings) else 0)


def test_config_rules_that_need_this_machine(make_cfg):
    cpu_only = FakeProbe(torch_info={"version": "2.5.1+cpu", "cuda": None, "cuda_available": False, "devices": []})
    ctx = Context.from_config(make_cfg("precision=fp16", check_files=False))
    f = only(doctor.diagnose(cpu_only, ctx), "config")
    assert f.level is Level.error and "fp16 needs a CUDA GPU" in f.message
    assert only(doctor.diagnose(FakeProbe(), ctx), "config").level is Level.ok


def test_jit_ops_of_the_config_are_checked_in_the_directory_the_run_uses(make_cfg):
    probe = FakeProbe()
    root = jit_ops.build_root(probe.environ)
    assert str(root).startswith("/home/u/.cache/torch_extensions/dsrecipes/py")  # this environment's own
    f = only(doctor.diagnose(probe, Context.from_config(make_cfg("zero=stage2", "offload=cpu_optimizer", check_files=False))), "jit_ops")
    assert f.level is Level.ok and f.message == f"cpu_adam: built ({root / 'cpu_adam'})"
    assert str(root) in only(doctor.diagnose(probe, Context()), "torch_extensions").message
    f = only(doctor.diagnose(probe, Context.from_config(make_cfg("optimizer.torch_adam=false", check_files=False))),
             "jit_ops")
    assert f.level is Level.warn and "fused_adam: not built yet" in f.message and str(root / "fused_adam") in f.message
    assert f.fix.startswith("dsrecipes doctor --build-ops")
    f = only(doctor.diagnose(probe, Context.from_config(make_cfg(check_files=False))), "jit_ops")
    assert f.level is Level.ok and "needs no JIT-built op" in f.message  # the default: torch's Adam, no shm op


def test_jit_op_table_is_complete():
    assert set(jit_ops.BUILDERS) == set(jit_ops.JitOp)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold DeepSpeedCPUAdam build: 1-2 min on a quiet machine, ~9 min on a loaded 2-core one
def test_doctor_build_ops_builds_what_the_config_needs_where_the_run_looks(built_cpu_adam):
    """For real: `--build-ops offload=cpu_optimizer` builds DeepSpeedCPUAdam into this environment's directory under the
    cache root, and doctor then reports it built there (the build is the session's one: conftest.built_cpu_adam)."""
    env, done, root = built_cpu_adam
    tmp_path = Path(env["XDG_CACHE_HOME"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert root.parent == tmp_path / "torch_extensions" / "dsrecipes" and (root / "cpu_adam" / "cpu_adam.so").is_file()
    flags = re.search(r"^cflags = (.*)$", (root / "cpu_adam" / "build.ninja").read_text(), re.M).group(1).split()
    assert "-O3" in flags and "-fopenmp" in flags and "-g" not in flags  # DeepSpeed's flags, less the debug info
    assert "building DeepSpeed's cpu_adam" in done.stderr and f"cpu_adam: built ({root / 'cpu_adam'})" in done.stderr
    (f,) = [f for f in json.loads(done.stdout) if f["check"] == "jit_ops"]
    assert f["level"] == "ok" and f["message"] == f"cpu_adam: built ({root / 'cpu_adam'})"
