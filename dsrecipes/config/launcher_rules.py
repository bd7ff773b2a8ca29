"""What each launcher requires of a config, as a table (`RULES`, one entry per `LauncherKind`), for the collect-all
validation (`config/validate.py`). Rules shared by every launcher come first; a launcher's own rules sit in its row,
so adding a launcher is its builder (run/launch/builders.py), its option file and its row here
(tests/test_launcher_rules.py checks the table is complete). What reaches a command line, the ranks' environment or
a batch script is checked against the boundary's positive lists (`boundary/`)."""

from __future__ import annotations

import os
import re
from typing import Callable, Dict, List, Optional, Tuple

from dsrecipes.boundary.batch_script import PDSH_READS, batch_problems, run_dir_problem
from dsrecipes.boundary.launcher_args import FORCE_MULTI, extra_args_problems
from dsrecipes.boundary.rank_env import env_problems
from dsrecipes.boundary.values import HOST
from dsrecipes.core.schema import LauncherKind, TrainConfig

Rule = Callable[[TrainConfig], Optional[str]]  # one message naming its key, or None

_SLOTS = r"[A-Za-z0-9_.-]{1,253}(?::\d{1,4}(?:,\d{1,4})*)?"  # deepspeed --include/--exclude: host[:slots]@...
_HOST_SLOTS = re.compile(f"{_SLOTS}(?:@{_SLOTS})*", re.ASCII)  # ASCII digits only (issue 50)
_ENDPOINT = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:]{2,45}\])(?::\d{1,5})?", re.ASCII)


def _selection_key(cfg: TrainConfig) -> str:
    return "launcher.include" if cfg.launcher.include else "launcher.exclude"


def _no_device_selection(cfg: TrainConfig) -> Optional[str]:
    ln = cfg.launcher
    if ln.include or ln.exclude:
        return f"{_selection_key(cfg)}: --include/--exclude exist only for launcher=deepspeed, not {ln.kind.value}"
    return None


def _selection_without_num_gpus(cfg: TrainConfig) -> Optional[str]:
    ln = cfg.launcher
    if (ln.include or ln.exclude) and ln.num_gpus is not None:
        return (f"{_selection_key(cfg)}: deepspeed cannot combine --include/--exclude with --num_gpus; "
                "set launcher.num_gpus=null when selecting devices")
    return None


def _one_process(cfg: TrainConfig) -> Optional[str]:
    ln = cfg.launcher
    if (ln.num_gpus or 1) > 1 or ln.num_nodes > 1:
        return "launcher.kind: the local launcher runs one process; use launcher=deepspeed for several"
    return None


def _hostfile_for_nodes(what: str) -> Rule:
    def rule(cfg: TrainConfig) -> Optional[str]:
        if cfg.launcher.num_nodes > 1 and not cfg.launcher.hostfile:
            return f"launcher.hostfile: {what} on several nodes needs a hostfile"
        return None
    return rule


def _deepspeed_hostfile(cfg: TrainConfig) -> Optional[str]:
    problem = _hostfile_for_nodes("launcher=deepspeed")(cfg)
    return problem and problem + " (or use launcher=deepspeed_multinode for the no-ssh mode)"


def _gpus_per_node(cfg: TrainConfig) -> Optional[str]:
    ln = cfg.launcher
    if ln.num_gpus is None:
        return (f"launcher.num_gpus: launcher={ln.kind.value} starts ranks on other machines, so say how many per "
                "node (this machine's device count is not theirs)")
    return None


def _rendezvous(cfg: TrainConfig) -> Optional[str]:
    ln = cfg.launcher
    if ln.num_nodes > 1 and not ln.rdzv_endpoint and ln.master_addr in ("127.0.0.1", "localhost"):
        return ("launcher.rdzv_endpoint: torchrun on several nodes needs a rendezvous host:port "
                "(or launcher.master_addr set to node 0's address)")
    return None


def _batch_run_dir(cfg: TrainConfig) -> Optional[str]:
    if cfg.trainer.output_dir:
        return run_dir_problem(os.path.abspath(os.path.expanduser(cfg.trainer.output_dir)))
    return None


def _pdsh_run_dir(cfg: TrainConfig) -> Optional[str]:
    ln = cfg.launcher  # the runner hands the run directory to pdsh's remote shells
    if (ln.hostfile or FORCE_MULTI in ln.extra_args) and cfg.trainer.output_dir:
        return run_dir_problem(os.path.abspath(os.path.expanduser(cfg.trainer.output_dir)), PDSH_READS)
    return None


RULES: Dict[LauncherKind, Tuple[Rule, ...]] = {
    LauncherKind.local: (_no_device_selection, _one_process),
    LauncherKind.deepspeed: (_selection_without_num_gpus, _deepspeed_hostfile, _pdsh_run_dir),
    LauncherKind.deepspeed_multinode: (_no_device_selection, _gpus_per_node),
    LauncherKind.torchrun: (_no_device_selection, _rendezvous),
    LauncherKind.mpirun: (_no_device_selection, _hostfile_for_nodes("mpirun")),
    LauncherKind.slurm: (_no_device_selection, _gpus_per_node, _batch_run_dir),
}


def _common(cfg: TrainConfig) -> List[str]:
    ln, errors = cfg.launcher, []
    if ln.num_gpus is not None and ln.num_gpus < 1:
        errors.append(f"launcher.num_gpus: must be >= 1, got {ln.num_gpus}")
    if ln.peer_timeout_s < 0 or 0 < ln.peer_timeout_s < 5:
        errors.append(f"launcher.peer_timeout_s: 0 (off) or >= 5 seconds, got {ln.peer_timeout_s}")
    errors += _stall_bounds(ln)
    if ln.rendezvous_timeout_s < 5:
        errors.append(f"launcher.rendezvous_timeout_s: must be >= 5 seconds, got {ln.rendezvous_timeout_s}")
    if ln.num_nodes < 1:
        errors.append(f"launcher.num_nodes: must be >= 1, got {ln.num_nodes}")
    if ln.include and ln.exclude:
        errors.append("launcher.exclude: use launcher.include or launcher.exclude, not both")
    if not 0 <= ln.node_rank < ln.num_nodes:
        errors.append(f"launcher.node_rank: must be in [0, {ln.num_nodes}), got {ln.node_rank}")
    if ln.master_port is not None and not 1 <= ln.master_port <= 65535:
        errors.append(f"launcher.master_port: must be in 1..65535, got {ln.master_port}")
    if ln.slurm_time_min < 1:
        errors.append(f"launcher.slurm_time_min: must be >= 1, got {ln.slurm_time_min}")
    return errors


def _stall_bounds(ln) -> List[str]:
    """launcher.stall_warn_s / stall_timeout_s: seconds >= 0 (0: off), the warning before the end."""
    for key in ("stall_warn_s", "stall_timeout_s"):
        value = getattr(ln, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return [f"launcher.{key}: whole seconds >= 0 (0: off), got {value!r}"]
    if ln.stall_warn_s and ln.stall_timeout_s and ln.stall_warn_s > ln.stall_timeout_s:
        return [f"launcher.stall_warn_s: must be <= launcher.stall_timeout_s ({ln.stall_timeout_s}) so the warning "
                f"comes before the run ends, got {ln.stall_warn_s}"]
    return []


def boundary_problems(ln) -> List[str]:
    """What a config would put on a command line, into the ranks' environment or into a batch script, checked
    against the boundary's positive lists (every refused item named)."""
    problems = extra_args_problems(ln.kind, list(ln.extra_args)) + env_problems(ln.env) + batch_problems(ln)
    if HOST.check(str(ln.master_addr)):
        problems.append(f"launcher.master_addr: needs {HOST.expected}, got {ln.master_addr!r}")
    for key in ("include", "exclude"):
        value = getattr(ln, key)
        if value is not None and not _HOST_SLOTS.fullmatch(str(value)):
            problems.append(f"launcher.{key}: needs hosts and slots such as 'localhost:0,1' or 'node1@node2:0', "
                            f"got {value!r}")
    if ln.rdzv_endpoint is not None and not _ENDPOINT.fullmatch(str(ln.rdzv_endpoint)):
        problems.append(f"launcher.rdzv_endpoint: needs HOST or HOST:PORT, got {ln.rdzv_endpoint!r}")
    if ln.hostfile is not None and any(c in str(ln.hostfile) for c in "\n\r\0"):
        problems.append("launcher.hostfile: the path holds a line break or NUL")
    return problems


def launcher_problems(cfg: TrainConfig) -> List[str]:
    """Every launcher rule `cfg` breaks: its launcher's row, the shared ones, then the boundary's lists."""
    own = [problem for rule in RULES[cfg.launcher.kind] if (problem := rule(cfg))]
    return own + _common(cfg) + boundary_problems(cfg.launcher)
