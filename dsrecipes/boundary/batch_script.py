"""SLURM: what a recipe may put into the batch script, as typed fields (no shell text).

    launcher.slurm_modules      `module load NAME` for each name (MODULE_NAME: cuda/12.1, gcc/11.2.0, ...)
    launcher.slurm_venv         `source VENV/bin/activate` (an absolute path, no '.'/'..' segments, no shell characters)
    launcher.slurm_conda_env    `conda activate NAME` (after conda's bash hook)
    launcher.slurm_sbatch_args  `#SBATCH --key=value` with keys from SBATCH_ALLOWED, each value of its type
    launcher.slurm_partition / slurm_account   `#SBATCH --partition` / `--account` (names)

The free shell text of the retired `launcher.slurm_setup` is gone (schema.py RETIRED_KEYS says what replaces
it). Every value is checked against a shape that holds no whitespace, quote, `$` or line break, and is still quoted
where the shell reads it; directives dsrecipes writes itself (nodes, time, output, requeue, ...) point to their field.
"""

from __future__ import annotations

import shlex
from typing import Dict, List, Optional

from dsrecipes.boundary.values import FLAG, MODULE_NAME, NAME, SIZE, Value, choice, integer, path_problem, shape
from dsrecipes.core.errors import ConfigError

_MAIL = ("NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
         "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS")
SBATCH_ALLOWED: Dict[str, Value] = {
    "qos": NAME, "reservation": NAME, "wckey": NAME,
    "constraint": shape(r"[A-Za-z0-9_.,:&|*\[\]()-]{1,256}", "a feature expression such as a100&ib"),
    "mem": SIZE, "mem-per-gpu": SIZE, "mem-per-cpu": SIZE,
    "cpus-per-task": integer(1, 4096), "cpus-per-gpu": integer(1, 4096),
    "gres": shape(r"[a-z]{1,16}(?::[A-Za-z0-9_.-]{1,32})?(?::\d{1,4})?(?:,[a-z]{1,16}(?::[A-Za-z0-9_.-]{1,32})?"
                  r"(?::\d{1,4})?)*", "generic resources such as gpu:a100:8"),
    "exclusive": FLAG, "nodelist": shape(r"[A-Za-z0-9_.,\[\]-]{1,512}", "a host list such as node[01-04]"),
    "exclude": shape(r"[A-Za-z0-9_.,\[\]-]{1,512}", "a host list such as node[01-04]"),
    "mail-type": choice(*_MAIL, many=True), "mail-user": shape(r"[A-Za-z0-9_.+-]{1,64}@[A-Za-z0-9.-]{1,253}",
                                                                "an e-mail address"),
    "hint": choice("compute_bound", "memory_bound", "multithread", "nomultithread"),
    "nice": integer(0, 10000), "switches": integer(1, 64),
}
# Directives whose value is an address outside this machine (Slurm mails the job's events there): the user's own,
# never a shared recipe's (config/safety.py refuses one a shared recipe set).
USER_NAMED_DIRECTIVES = ("mail-user",)
OWN_DIRECTIVES = {"job-name": "the run directory's name", "nodes": "launcher.num_nodes",
                  "ntasks-per-node": "one task per node", "gpus-per-node": "launcher.num_gpus",
                  "time": "launcher.slurm_time_min", "output": "the run directory", "requeue": "always on",
                  "signal": "the requeue signal", "partition": "launcher.slurm_partition",
                  "account": "launcher.slurm_account"}


def batch_problems(ln) -> List[str]:
    """Every problem with the SLURM fields of `ln` (a LauncherConfig), each naming its key."""
    problems = []
    for i, name in enumerate(ln.slurm_modules):
        if MODULE_NAME.check(str(name)):
            problems.append(f"launcher.slurm_modules[{i}]: needs {MODULE_NAME.expected}, got {name!r}")
    if ln.slurm_venv is not None and path_problem(str(ln.slurm_venv)):
        problems.append(f"launcher.slurm_venv: needs {path_problem(str(ln.slurm_venv))} (the virtual environment's "
                        f"directory), got {ln.slurm_venv!r}")
    if ln.slurm_conda_env is not None and NAME.check(str(ln.slurm_conda_env)):
        problems.append(f"launcher.slurm_conda_env: needs {NAME.expected}, got {ln.slurm_conda_env!r}")
    if ln.slurm_venv is not None and ln.slurm_conda_env is not None:
        problems.append("launcher.slurm_conda_env: set launcher.slurm_venv or launcher.slurm_conda_env, not both")
    for key in ("slurm_partition", "slurm_account"):
        value = getattr(ln, key)
        if value is not None and NAME.check(str(value)):
            problems.append(f"launcher.{key}: needs {NAME.expected}, got {value!r}")
    for i, arg in enumerate(ln.slurm_sbatch_args):
        problem = _directive_problem(str(arg))
        if problem:
            problems.append(f"launcher.slurm_sbatch_args[{i}]: {problem}")
    return problems


def directive_key(arg: str) -> Optional[str]:
    """`qos` of `--qos=high`; None for anything not of the form --key[=value]."""
    name = arg.partition("=")[0]
    return name[2:] if name.startswith("--") else None


def _directive_problem(arg: str) -> str:
    name, eq, value = arg.partition("=")
    key = directive_key(arg)
    if key in OWN_DIRECTIVES:
        return f"{name} is written by dsrecipes ({OWN_DIRECTIVES[key]})"
    if key not in SBATCH_ALLOWED:
        return (f"{arg!r} is not an allowed #SBATCH directive; allowed: "
                f"{', '.join('--' + k for k in SBATCH_ALLOWED)} (as --key=value)")
    kind = SBATCH_ALLOWED[key]
    if kind.flag:
        return f"{name} takes no value" if eq else ""
    if not eq:
        return f"{name} needs a value: {name}=VALUE ({kind.expected})"
    wrong = kind.check(value)
    return f"{name} needs {wrong}, got {value!r}" if wrong else ""


def checked_batch_fields(ln) -> None:
    problems = batch_problems(ln)
    if problems:
        raise ConfigError(problems)


def directive_lines(ln) -> List[str]:
    """The `#SBATCH` lines from the typed fields (checked first)."""
    checked_batch_fields(ln)
    lines = [f"#SBATCH --partition={ln.slurm_partition}"] if ln.slurm_partition else []
    lines += [f"#SBATCH --account={ln.slurm_account}"] if ln.slurm_account else []
    return lines + [f"#SBATCH {arg}" for arg in ln.slurm_sbatch_args]


def setup_lines(ln) -> List[str]:
    """Shell lines before srun: modules, then the environment to activate (checked first, and quoted)."""
    checked_batch_fields(ln)
    lines = [f"module load {shlex.quote(m)}" for m in ln.slurm_modules]
    if ln.slurm_venv:
        lines.append(f"source {shlex.quote(ln.slurm_venv.rstrip('/') + '/bin/activate')}")
    if ln.slurm_conda_env:
        lines += ['eval "$(conda shell.bash hook)"', f"conda activate {shlex.quote(ln.slurm_conda_env)}"]
    return lines


SLURM_READS = "launcher=slurm writes {!r} into a batch script"
PDSH_READS = ("launcher=deepspeed with a hostfile or --force_multi hands {!r} to pdsh, whose remote shell on every host reads "
              "it (DeepSpeed quotes nothing)")


def run_dir_problem(run_dir: str, reader: str = SLURM_READS) -> str:
    """The run directory as a shell reads it (`#SBATCH --output=` and the script's lines; pdsh's remote command
    line): a path of the safe shape. `reader` says which shell, with {!r} for the path."""
    wrong = path_problem(run_dir)
    return f"trainer.output_dir: {reader.format(run_dir)}, so it must be {wrong}" if wrong else ""

