"""`dsrecipes doctor [overrides] [--json]`: is this machine able to train, and if not, what to change.

Each check reads the machine through a `Probe` (so tests can fake a machine) and returns findings with a fix.
Nothing here builds a DeepSpeed op or starts a process group (unless asked: `--build-ops` builds the JIT ops the
config needs ahead of the first run, into the directory the run uses: jit_ops.py): it reads versions, paths, PATH
and file systems only, so it runs in a few seconds. Exit code 1 when something makes training impossible, else 0.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, List, Optional

from dsrecipes.core.jit_ops import JitOp, build_root, describe_build, ops_for
from dsrecipes.core.schema import OffloadDevice, TrainConfig
from dsrecipes.run.machine import Probe

GIB = 1024**3


class Level(str, Enum):
    ok = "ok"
    warn = "warn"
    error = "error"


@dataclass
class Finding:
    check: str
    level: Level
    message: str
    fix: Optional[str] = None


@dataclass
class Context:
    """What the configured run needs (from the composed config), so findings can say warn vs error."""

    num_workers: int = 0
    needs_jit: bool = False  # DeepSpeedCPUAdam / FusedAdam are JIT-built
    needs_aio: bool = False  # offload to NVMe
    config: Optional[TrainConfig] = None  # the composed config, when composing worked
    jit_ops: List[JitOp] = field(default_factory=list)  # what DeepSpeed builds for this config

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "Context":
        offloads = (cfg.offload.optimizer, cfg.offload.param)
        return cls(
            num_workers=cfg.data.num_workers,
            needs_jit=cfg.offload.optimizer is not OffloadDevice.none or not cfg.optimizer.torch_adam,
            needs_aio=OffloadDevice.nvme in offloads,
            config=cfg,
            jit_ops=ops_for(cfg),
        )


# ---------------------------------------------------------------------------------------------------------------
# Checks: (probe, context) -> findings


def check_packages(probe: Probe, ctx: Context) -> List[Finding]:
    required = {"torch": None, "deepspeed": None, "transformers": None, "hydra-core": "1.3.", "omegaconf": "2.3."}
    out = [Finding("python", Level.ok, f"Python {sys.version.split()[0]} at {sys.executable}")]
    for dist, prefix in required.items():
        ver = probe.version(dist)
        if ver is None:
            out.append(Finding(dist, Level.error, f"{dist} is not installed", f"pip install -e . (installs {dist})"))
        elif prefix and not ver.startswith(prefix):
            out.append(
                Finding(
                    dist, Level.error, f"{dist} {ver}; dsrecipes needs {prefix}x", f"pip install '{dist}=={prefix}*'"
                )
            )
        else:
            out.append(Finding(dist, Level.ok, f"{dist} {ver}"))
    for dist in ("datasets", "tokenizers", "peft", "ninja", "mpi4py"):
        ver = probe.version(dist)
        out.append(Finding(dist, Level.ok, f"{dist} {ver}" if ver else f"{dist} not installed (optional)"))
    return out


def check_torch(probe: Probe, ctx: Context) -> List[Finding]:
    if probe.version("torch") is None:
        return []
    t = probe.torch()
    if not t["cuda"]:
        return [Finding("device", Level.ok, f"torch {t['version']} (CPU build): ranks train on CPU over gloo")]
    if not t["cuda_available"]:
        return [
            Finding(
                "cuda",
                Level.warn,
                f"torch {t['version']} is built for CUDA {t['cuda']} but sees no GPU",
                "check `nvidia-smi`, the driver, and CUDA_VISIBLE_DEVICES; CPU training still works",
            )
        ]
    names = ", ".join(sorted(set(map(str, t["devices"]))))
    out = [Finding("cuda", Level.ok, f"torch {t['version']}, CUDA {t['cuda']}, NCCL {t.get('nccl')}, "
                                     f"{len(t['devices'])} GPU(s): {names}")]  # fmt: skip
    if not t.get("bf16"):
        out.append(Finding("bf16", Level.warn, "these GPUs have no bf16", "use precision=fp16 or precision=fp32"))
    return out


def check_accelerator(probe: Probe, ctx: Context) -> List[Finding]:
    if probe.version("deepspeed") is None or probe.version("torch") is None:
        return []
    try:
        name = probe.accelerator()
    except Exception as exc:  # noqa: BLE001 - any failure here is the finding
        return [Finding("accelerator", Level.error, f"deepspeed cannot pick an accelerator: {exc}",
                        "unset DS_ACCELERATOR, or set it to cuda/cpu")]  # fmt: skip
    forced = probe.environ.get("DS_ACCELERATOR")
    if probe.torch()["cuda_available"] and name != "cuda":
        return [Finding("accelerator", Level.error, f"GPUs are visible but DeepSpeed uses '{name}'"
                        + (f" (DS_ACCELERATOR={forced})" if forced else ""), "unset DS_ACCELERATOR")]  # fmt: skip
    return [Finding("accelerator", Level.ok, f"DeepSpeed accelerator: {name}")]


def check_cuda_home(probe: Probe, ctx: Context) -> List[Finding]:
    home = probe.environ.get("CUDA_HOME") or probe.environ.get("CUDA_PATH")
    if home is None:
        nvcc = probe.which("nvcc")
        where = f"nvcc on PATH: {nvcc}" if nvcc else "no nvcc on PATH"
        return [Finding("cuda_home", Level.ok, f"CUDA_HOME unset ({where})")]
    if ":" in home:
        return [Finding("cuda_home", Level.error, f"CUDA_HOME={home!r} holds a path list; JIT builds treat it as one "
                        "directory and fail", "export CUDA_HOME=/usr/local/cuda (one directory)")]  # fmt: skip
    if not probe.exists(home):
        return [Finding("cuda_home", Level.error, f"CUDA_HOME={home} does not exist; DeepSpeed/torch JIT builds "
                        "will fail", "point CUDA_HOME at the toolkit (e.g. /usr/local/cuda) or unset it")]  # fmt: skip
    if not probe.exists(os.path.join(home, "bin", "nvcc")):
        return [Finding("cuda_home", Level.warn, f"CUDA_HOME={home} has no bin/nvcc", "point it at a full toolkit")]
    return [Finding("cuda_home", Level.ok, f"CUDA_HOME={home}")]


def _nvcc_path(probe: Probe) -> Optional[str]:
    home = probe.environ.get("CUDA_HOME")
    if home and ":" not in home and probe.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return probe.which("nvcc")


def check_nvcc(probe: Probe, ctx: Context) -> List[Finding]:
    nvcc = _nvcc_path(probe)
    torch_cuda = probe.torch()["cuda"] if probe.version("torch") else None
    if nvcc is None:
        if torch_cuda:
            return [Finding("nvcc", Level.warn, "no nvcc: CUDA ops that DeepSpeed JIT-builds (FusedAdam, ...) cannot "
                            "build; torch's Adam (optimizer.torch_adam=true) needs none",
                            "install the CUDA toolkit matching torch, or keep optimizer.torch_adam=true")]  # fmt: skip
        return []
    text = probe.run([nvcc, "--version"]) or ""
    match = re.search(r"release (\d+)\.(\d+)", text)
    if not match:
        return [Finding("nvcc", Level.warn, f"cannot read the version of {nvcc}")]
    nvcc_ver = f"{match.group(1)}.{match.group(2)}"
    if not torch_cuda:
        return [Finding("nvcc", Level.ok, f"nvcc {nvcc_ver} ({nvcc}); CPU torch does not use it")]
    if match.group(1) != str(torch_cuda).split(".")[0]:
        return [
            Finding(
                "nvcc",
                Level.warn,
                f"nvcc {nvcc_ver} but torch is built for CUDA {torch_cuda}: DeepSpeed "
                "refuses to JIT-build CUDA ops across major versions",
                "install the toolkit matching torch (or a torch build matching nvcc), and set CUDA_HOME to it",
            )
        ]
    return [Finding("nvcc", Level.ok, f"nvcc {nvcc_ver} matches torch's CUDA {torch_cuda}")]


def check_compilers(probe: Probe, ctx: Context) -> List[Finding]:
    cxx = probe.environ.get("CXX") or probe.which("c++") or probe.which("g++")
    ninja = probe.which("ninja")
    missing = [name for name, found in (("a C++ compiler", cxx), ("ninja", ninja)) if not found]
    if not missing:
        return [Finding("jit", Level.ok, f"JIT builds possible: C++ {cxx}, ninja {ninja}")]
    level = Level.error if ctx.needs_jit else Level.warn
    why = ("this config uses a JIT-built optimizer (CPU offload -> DeepSpeedCPUAdam, or optimizer.torch_adam=false)"
           if ctx.needs_jit else "DeepSpeed cannot JIT-build ops (CPU offload Adam, the CPU shm comm op)")  # fmt: skip
    return [Finding("jit", level, f"missing {' and '.join(missing)}: {why}",
                    "apt install build-essential && pip install ninja")]  # fmt: skip


def check_aio(probe: Probe, ctx: Context) -> List[Finding]:
    lib = probe.find_library("aio")
    header = probe.exists("/usr/include/libaio.h")
    if lib and header:
        return [Finding("libaio", Level.ok, f"libaio found ({lib}): NVMe offload can build its async I/O op")]
    what = "libaio missing" if not lib else "libaio headers missing"
    if not ctx.needs_aio:
        return [Finding("libaio", Level.ok, f"{what} (only offload=nvme needs it)")]
    return [Finding("libaio", Level.error, f"{what}: offload=nvme cannot build its async I/O op",
                    "apt install libaio-dev")]  # fmt: skip


def check_shm(probe: Probe, ctx: Context) -> List[Finding]:
    size = probe.shm_bytes()
    if size is None:
        return [Finding("shm", Level.warn, "/dev/shm is missing", "DataLoader workers need it; use data.num_workers=0")]
    msg = f"/dev/shm: {size / GIB:.1f} GiB"
    if size < GIB and ctx.num_workers > 0:
        return [Finding("shm", Level.error, f"{msg} with data.num_workers={ctx.num_workers}: workers pass batches "
                        "through shared memory and die with 'bus error'",
                        "docker run --shm-size=16g (or --ipc=host), or data.num_workers=0")]  # fmt: skip
    if size < GIB:
        return [Finding("shm", Level.warn, f"{msg}: small; DataLoader workers would fail",
                        "docker run --shm-size=16g before raising data.num_workers")]  # fmt: skip
    return [Finding("shm", Level.ok, msg)]


def check_extensions_cache(probe: Probe, ctx: Context) -> List[Finding]:
    root = str(build_root(probe.environ))  # the directory the ranks build into (this environment's own)
    out = []
    if not probe.writable(root):
        out.append(
            Finding(
                "torch_extensions",
                Level.error if ctx.needs_jit else Level.warn,
                f"{root} is not writable: JIT builds cannot cache",
                "export TORCH_EXTENSIONS_DIR=/writable/dir",
            )
        )
    stale = [(p, age) for p, age in probe.lock_files(root) if age > 600]
    for path, age in stale:
        out.append(
            Finding(
                "torch_extensions",
                Level.warn,
                f"stale build lock {path} ({age / 60:.0f} min old): the next build of this op waits forever",
                f"rm {path}  (when no build is running)",
            )
        )
    if not out:
        built = probe.built_ops(root)
        out.append(Finding("torch_extensions", Level.ok, f"{root}: built ops: {', '.join(built) or 'none yet'}"))
    return out


def check_jit_ops(probe: Probe, ctx: Context) -> List[Finding]:
    """The JIT ops this config makes DeepSpeed build, and whether this environment's directory has them yet.
    (Training builds no shared-memory op: distributed.skip_shm_comm_op.)"""
    root = build_root(probe.environ)
    if not ctx.jit_ops:
        return [Finding("jit_ops", Level.ok, "this config needs no JIT-built op (DeepSpeed's CPU shared-memory op is "
                        "not used for training and not built)")]  # fmt: skip
    built = set(probe.built_ops(str(root)))
    out = []
    for op in ctx.jit_ops:
        if op.value in built:
            out.append(Finding("jit_ops", Level.ok, f"{op.value}: built ({root / op.value})"))
        else:
            out.append(Finding("jit_ops", Level.warn, f"{op.value}: not built yet; the first run does it. "
                               + describe_build(op.value, root).removeprefix("dsrecipes: "),
                               "dsrecipes doctor --build-ops [the run's overrides]  (builds it now)"))  # fmt: skip
    return out


def check_config(probe: Probe, ctx: Context) -> List[Finding]:
    """The config's machine-dependent rules (fp16 or flash attention without CUDA, ...), as the entry applies them."""
    if ctx.config is None or probe.version("torch") is None:
        return []
    from dsrecipes.config.validate import check_runtime  # lazy: else `commands.doctor` imports numpy 0.11 s

    # libaio for offload=nvme is check_aio's finding, from the probed environment: not asked again here
    problems = check_runtime(ctx.config, cuda_available=bool(probe.torch()["cuda_available"]), async_io=True)
    if not problems:
        return [Finding("config", Level.ok, "the composed config can run on this machine")]
    return [Finding("config", Level.error, p) for p in problems]


CHECKS: List[Callable[[Probe, Context], List[Finding]]] = [
    check_packages,
    check_torch,
    check_accelerator,
    check_cuda_home,
    check_nvcc,
    check_compilers,
    check_aio,
    check_shm,
    check_extensions_cache,
    check_jit_ops,
    check_config,
]


def diagnose(probe: Probe, ctx: Context) -> List[Finding]:
    findings: List[Finding] = []
    for check in CHECKS:
        try:
            findings += check(probe, ctx)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            findings.append(Finding(check.__name__.replace("check_", ""), Level.warn, f"check failed: {exc!r}"))
    return findings


def render(findings: List[Finding]) -> str:
    mark = {Level.ok: "ok   ", Level.warn: "WARN ", Level.error: "ERROR"}
    lines = []
    for f in findings:
        lines.append(f"[{mark[f.level]}] {f.check}: {f.message}")
        if f.fix and f.level is not Level.ok:
            lines.append(f"        fix: {f.fix}")
    errors = sum(f.level is Level.error for f in findings)
    warns = sum(f.level is Level.warn for f in findings)
    lines.append(f"\n{errors} error(s), {warns} warning(s)" + (": training cannot work here" if errors else ""))
    return "\n".join(lines)


