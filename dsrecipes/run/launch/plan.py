"""What a launcher produces: commands, support files and requirements (pure data; nothing here runs)."""

from __future__ import annotations

import importlib.util
import math
import shlex
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

WORKER_MODULE = "dsrecipes.rank.worker"
LAUNCH_FILE = "launch.txt"
SBATCH_FILE = "launch.sbatch"
HOSTFILE = "hostfile"
DS_ENV_FILE = ".deepspeed_env"
# Inherited rank variables would confuse the ranks we start (and make DeepSpeed skip MPI discovery).
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")
# torchrun SIGKILLs its ranks this long after it passed on a stop signal (default 30 s): set past the ranks' grace, so
# a step and checkpoint that take longer than 30 s are not killed before trainer.stop_grace_s (then the launching
# process ends them, naming them). A user's own value (exported, --shutdown_timeout in launcher.extra_args) stands.
TORCHRUN_SHUTDOWN = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHRUN_SHUTDOWN_MARGIN_S = 10


def torchrun_shutdown(grace_s: float, *given: Mapping[str, str]) -> Dict[str, str]:
    """TORCHRUN_SHUTDOWN past `grace_s`, unless one of the environments `given` sets it already ({} then)."""
    if any(TORCHRUN_SHUTDOWN in env for env in given):
        return {}
    return {TORCHRUN_SHUTDOWN: str(math.ceil(grace_s) + TORCHRUN_SHUTDOWN_MARGIN_S)}


@dataclass(frozen=True)
class Command:
    """One command line. `env` is set on top of this process's environment (minus inherited rank variables)."""

    argv: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    node_rank: Optional[int] = None  # multi-node: the node that runs it; None = this machine (or every node)
    # launcher=local: `dsrecipes.rank.worker.run(run_dir)` in this process, argv shown only; a sweep's job runs the
    # argv as a child process (run/launch/process.py run_in_process)
    in_process: bool = False

    def shell(self) -> str:
        prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join(prefix + [shlex.join(self.argv)])


@dataclass(frozen=True)
class Requirement:
    """Something a plan needs on this machine: an executable on PATH or an importable module."""

    name: str
    module: bool
    why: str

    def missing(self) -> bool:
        if self.module:
            return importlib.util.find_spec(self.name) is None
        return shutil.which(self.name) is None


@dataclass
class LaunchPlan:
    commands: List[Command]
    files: Dict[str, str] = field(default_factory=dict)  # name inside the run dir -> content
    requires: List[Requirement] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # printed in launch.txt: how to use the commands




def render_plan(kind: str, plan: LaunchPlan) -> str:
    """`<run>/launch.txt`: the commands with their notes, so a run can be re-launched or inspected by hand."""
    lines = [f"# launcher={kind} (written by dsrecipes)"]
    lines += [f"# note: {n}" for n in plan.notes]
    lines += [f"# warning: {w}" for w in plan.warnings]
    lines += [f"# wrote {name} into the run directory" for name in plan.files]
    for cmd in plan.commands:
        if cmd.node_rank is not None:
            lines.append(f"# node {cmd.node_rank}")
        lines.append(cmd.shell())
    return "\n".join(lines) + "\n"
