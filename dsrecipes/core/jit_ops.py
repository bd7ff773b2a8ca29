"""DeepSpeed's JIT-built C++ ops: one build directory per Python environment, and a word on the console before a build.

torch builds an extension into TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py311_cpu/<op>, and the op's
build.ninja records the include paths of the environment that built it. Two environments on one machine (two
checkouts, a wheel beside an editable install, several venvs on a login node) sharing that directory rebuild each
other's op on every launch, minutes each time. `build_root()` keys the directory by the interpreter prefix
(sys.prefix) and the torch and DeepSpeed versions, unless the user set TORCH_EXTENSIONS_DIR themselves; the ranks
use it (`prepare_rank`) and `dsrecipes doctor` checks the same directory (it passes its probe's environment).

Which ops a CPU training run builds: DeepSpeed's CPU accelerator loads `deepspeed_shm_comm` in every multi-rank
process group, but only `inference_all_reduce` (AutoTP inference layers) calls it; training's collectives (ZeRO
all-reduce, reduce-scatter, all-gather) go to torch.distributed on gloo. dsrecipes ranks only train, so they skip
that op (no build, no ~70 MB /dev/shm segment per rank) - see `distributed.skip_shm_comm_op`. What is left is built
only when the config asks for it: DeepSpeedCPUAdam for `offload=cpu_optimizer`, FusedAdam for `optimizer.torch_adam=false`.

In our own directory (not a TORCH_EXTENSIONS_DIR the user chose), ops build without `-g`: DeepSpeed compiles its C++
ops with `-O3 -g`, and the debug information is a third of a cold build (measured on the 2-core test machine, CPU
Adam: 182 CPU s / 95 s wall with it, 120 CPU s / 63 s without) for symbols only a C++ debugger reads. The same code,
optimisation and ISA flags otherwise. torch keys a JIT build by its flags, so every dsrecipes process that loads an
op (ranks, `doctor --build-ops`) drops the flag alike and they share one build; a directory the user chose keeps
DeepSpeed's flags, so plain DeepSpeed processes sharing it never rebuild over each other.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from enum import Enum
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Mapping, Optional

from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.errors import UserError
from dsrecipes.core.paths import user_cache_dir
from dsrecipes.core.schema import OffloadDevice, OptimizerKind

if TYPE_CHECKING:
    from dsrecipes.core.schema import TrainConfig

ENV = "TORCH_EXTENSIONS_DIR"
SUBDIR = "dsrecipes"  # under torch's default root: our keyed directories beside torch's own py311_cpu


class JitOp(str, Enum):
    """The JIT ops a dsrecipes config can make DeepSpeed build (DeepSpeed's op names)."""

    cpu_adam = "cpu_adam"
    cpu_lion = "cpu_lion"
    fused_adam = "fused_adam"
    fused_lion = "fused_lion"
    async_io = "async_io"


# op -> (DeepSpeed's builder class, what it is in words)
BUILDERS = {
    JitOp.cpu_adam: ("CPUAdamBuilder", "DeepSpeedCPUAdam, the optimizer step of an offloaded adam/adamw"),
    JitOp.cpu_lion: ("CPULionBuilder", "DeepSpeedCPULion, the optimizer step of an offloaded lion"),
    JitOp.fused_adam: ("FusedAdamBuilder", "FusedAdam, for optimizer.torch_adam=false"),
    JitOp.fused_lion: ("FusedLionBuilder", "FusedLion, DeepSpeed's lion optimizer"),
    JitOp.async_io: ("AsyncIOBuilder", "asynchronous file I/O for offload to NVMe"),
}
WHAT = {op.value: what for op, (_, what) in BUILDERS.items()}
WHAT["deepspeed_shm_comm"] = "the CPU shared-memory all-reduce"


def ops_for(cfg: "TrainConfig") -> List[JitOp]:
    """The ops DeepSpeed builds for this config (its optimizer choice: ds_config.py; offload targets)."""

    name, offloaded = cfg.optimizer.name, cfg.offload.optimizer is not OffloadDevice.none
    ops = []
    if offloaded and name in (OptimizerKind.adam, OptimizerKind.adamw):
        ops.append(JitOp.cpu_adam)
    elif offloaded and name is OptimizerKind.lion:
        ops.append(JitOp.cpu_lion)
    elif name in (OptimizerKind.adam, OptimizerKind.adamw) and not cfg.optimizer.torch_adam:
        ops.append(JitOp.fused_adam)
    elif name is OptimizerKind.lion:
        ops.append(JitOp.fused_lion)
    if OffloadDevice.nvme in (cfg.offload.optimizer, cfg.offload.param):
        ops.append(JitOp.async_io)
    return ops


def _builder(op: JitOp) -> Any:
    """DeepSpeed's builder of `op` for this machine's accelerator (None when the accelerator has no such op)."""
    load_deepspeed()
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(BUILDERS[op][0])


def build(op: JitOp) -> Path:
    """Build (or load, when cached) `op` now, into this environment's directory (`dsrecipes doctor --build-ops`)."""
    root = prepare_rank()
    builder = _builder(op)
    if builder is None:
        from deepspeed.accelerator import get_accelerator

        raise RuntimeError(f"DeepSpeed's {get_accelerator().device_name()} accelerator has no {op.value} op")
    builder.load(verbose=False)
    return root / builder.name


@functools.lru_cache(maxsize=1)
def async_io_buildable() -> bool:
    """Whether DeepSpeed can build its async_io op (offload to NVMe) here, by DeepSpeed's own test: it compiles and
    links a call to libaio's io_submit."""
    builder = _builder(JitOp.async_io)
    return builder is not None and bool(builder.is_compatible(verbose=False))


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "none"


def environment_key(prefix: Optional[str] = None, torch_version: Optional[str] = None,
                    deepspeed_version: Optional[str] = None) -> str:
    """`py311-torch2.13.0+cpu-ds0.19.8-<hash of the interpreter prefix>`: one per Python environment."""
    prefix = os.path.realpath(sys.prefix if prefix is None else prefix)
    torch_version = _version("torch") if torch_version is None else torch_version
    deepspeed_version = _version("deepspeed") if deepspeed_version is None else deepspeed_version
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    digest = hashlib.sha256(prefix.encode()).hexdigest()[:10]
    return f"{py}-torch{torch_version}-ds{deepspeed_version}-{digest}"


def default_root(environ: Mapping[str, str]) -> Path:
    """torch's own default root (torch.utils.cpp_extension.get_default_build_root), read from `environ`."""
    return Path(os.path.realpath(user_cache_dir(environ) / "torch_extensions"))


def build_root(environ: Optional[Mapping[str, str]] = None, key: Optional[str] = None) -> Path:
    """The directory this environment's JIT ops build into: the user's TORCH_EXTENSIONS_DIR when set, else ours."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV):
        return Path(environ[ENV])
    return default_root(environ) / SUBDIR / (key or environment_key())


def built(name: str, root: Optional[Path] = None) -> bool:
    root = build_root() if root is None else root
    return (root / name / f"{name}.so").is_file()


def describe_build(name: str, root: Path) -> str:
    what = WHAT.get(name, "a C++ op")
    return (f"dsrecipes: building DeepSpeed's {name} ({what}) for this Python environment, once: usually 1-3 "
            f"minutes, longer on a busy machine; later runs reuse it from {root / name}")


NO_DEBUG_INFO = "-g"  # the one DeepSpeed compiler flag dropped in our own build directory (module docstring)


def prepare_rank() -> Path:
    """In a rank, before any op loads: build into this environment's directory, and announce each build first (once
    per node: local rank 0). Returns the directory."""
    os.environ.setdefault(ENV, str(build_root()))  # torch reads it when it builds
    root = Path(os.environ[ENV])
    _announce_builds()
    _bound_build_waits()
    return root


BUILD_WAIT_S = 20 * 60  # another process's build of an op (1-3 minutes, longer on a busy machine) is waited this long
BUILD_NOTE_S = 30.0  # then the wait is said, naming the lock file


def _bound_build_waits() -> None:
    """torch waits for another process's build of an op while its lock file exists (FileBaton.wait): for ever, in
    silence, when a killed build left the file. Here that wait says which file after BUILD_NOTE_S and ends after
    BUILD_WAIT_S with one message naming it. Once per process."""
    from torch.utils import file_baton

    if getattr(file_baton.FileBaton.wait, "_dsrecipes_bounded", False):
        return

    def wait(self: Any) -> None:
        started, said, lock = time.monotonic(), False, self.lock_file_path
        while os.path.exists(lock):
            waited = time.monotonic() - started
            if waited >= BUILD_WAIT_S:
                raise UserError(f"{lock}: another process's build of this op held it for {waited:.0f} s; if no "
                                "build is running (a killed build leaves it behind), remove it and run again")
            if not said and waited >= BUILD_NOTE_S:
                said = True
                print(f"dsrecipes: waiting for another process's build of {Path(lock).parent.name} (lock file "
                      f"{lock}, up to {BUILD_WAIT_S:.0f} s); if no build is running, a killed one left it: remove "
                      "it", file=sys.stderr, flush=True)
            time.sleep(self.wait_seconds)

    wait._dsrecipes_bounded = True  # type: ignore[attr-defined]
    file_baton.FileBaton.wait = wait


def ours(root: Path) -> bool:
    """Whether `root` is a directory dsrecipes keys for this environment (`build_root()`'s `dsrecipes/<key>`, under
    whichever cache), not one the user chose for other processes too."""
    return root.name == environment_key() and root.parent.name == SUBDIR


def _announce_builds() -> None:
    """Wrap DeepSpeed's OpBuilder.jit_load (every JIT op goes through it) with a line before and after a build that
    is not cached yet, and (in our own directory) without `-g`. Once per process; the directory is the one torch
    builds into at that call (prepare_rank set it)."""
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except ImportError:  # another DeepSpeed layout: builds stay silent
        return
    original = OpBuilder.jit_load
    if getattr(original, "_dsrecipes_announces", False):
        return

    def jit_load(self, verbose=True):
        root = build_root()
        speak = os.environ.get("LOCAL_RANK", "0") == "0" and not built(self.name, root)
        if speak:
            print(describe_build(self.name, root), file=sys.stderr, flush=True)
        started = time.monotonic()
        if ours(root):
            flags = self.cxx_args  # the builder's own method, bound; the instance attribute goes again below
            self.cxx_args = lambda: [flag for flag in flags() if flag != NO_DEBUG_INFO]
        try:
            module = original(self, verbose)
        finally:
            self.__dict__.pop("cxx_args", None)
        if speak:
            print(f"dsrecipes: {self.name} built in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        return module

    jit_load._dsrecipes_announces = True
    OpBuilder.jit_load = jit_load
