"""`launcher=slurm`: an sbatch script with one srun task per node, each starting the no-ssh deepspeed launcher.

Preemption and time limits: the job is requeueable and gets USR1 `REQUEUE_SIGNAL_S` seconds before its time limit;
the batch shell then stops the ranks (SIGTERM: they checkpoint at the next step boundary, stopping.py) and requeues
the job. A preempted job gets SIGTERM from SLURM, which reaches the ranks the same way, and SLURM requeues it. A
requeued job (SLURM_RESTART_COUNT > 0) first plans the continuation from the newest verified checkpoint
(`python -m dsrecipes.run.requeue`), so it resumes by itself.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Mapping

from dsrecipes.boundary.batch_script import directive_lines, run_dir_problem, setup_lines
from dsrecipes.boundary.launcher_args import checked_extra_args
from dsrecipes.boundary.rank_env import checked_env
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.topology import per_node
from dsrecipes.run.launch.plan import SBATCH_FILE, WORKER_MODULE, Command, LaunchPlan, Requirement

REQUEUE_SIGNAL_S = 180  # USR1 this long before the time limit: time to checkpoint and requeue


def build_slurm(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str, environ: Mapping[str, str]):
    script = run_dir / SBATCH_FILE
    plan = LaunchPlan(
        [Command(["sbatch", str(script)])],
        files={SBATCH_FILE: sbatch_script(cfg, run_dir, port, worker_module)},
        requires=[Requirement("sbatch", False, "launcher=slurm submits with sbatch (run on a SLURM login node)")],
    )
    plan.notes.append(f"the job runs asynchronously; its log is {run_dir}/slurm-<jobid>.out")
    return plan


def sbatch_script(cfg: TrainConfig, run_dir: Path, port: int, worker_module: str = WORKER_MODULE) -> str:
    """One srun task per node; each starts the no-ssh deepspeed launcher with node rank SLURM_NODEID."""
    ln = cfg.launcher
    q = shlex.quote
    if run_dir_problem(str(run_dir)):
        raise ConfigError(run_dir_problem(str(run_dir)))
    env, extra = checked_env(ln.env), checked_extra_args(ln.kind, ln.extra_args)
    head = [
        "#!/bin/bash",
        f"# Written by dsrecipes for {run_dir}. Submit with: sbatch {run_dir / SBATCH_FILE}",
        f"#SBATCH --job-name=dsrecipes-{run_dir.name}",
        f"#SBATCH --nodes={ln.num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node(ln)}",
        f"#SBATCH --time={ln.slurm_time_min}",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{REQUEUE_SIGNAL_S}",
    ]
    head += directive_lines(ln)
    inner = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "$HOSTFILE",
        "--num_nodes", str(ln.num_nodes), "--num_gpus", str(per_node(ln)),
        "--no_ssh", "--node_rank", "$SLURM_NODEID", "--master_addr", "$MASTER_ADDR", "--master_port", "$MASTER_PORT",
        *extra,
        "--no_local_rank", "--module", worker_module, "--run-dir", str(run_dir),
    ]  # fmt: skip
    # $VARS stay unquoted inside the per-task shell so that each task expands its own SLURM_NODEID.
    inner_sh = " ".join(a if a.startswith("$") else q(a) for a in inner)
    body = [
        "set -euo pipefail",
        f"cd {q(os.getcwd())}",
        *setup_lines(ln),
        *[f"export {k}={q(v)}" for k, v in sorted(env.items())],
        # no `| head` under pipefail: scontrol would die of SIGPIPE on long node lists
        'HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "MASTER_ADDR=$(printf '%s\\n' $HOSTS | sed -n 1p)",
        f"MASTER_PORT={port}",
        f"HOSTFILE={q(str(run_dir))}/hostfile.$SLURM_JOB_ID",
        f"printf '%s slots={per_node(ln)}\\n' $HOSTS > \"$HOSTFILE\"",
        "export MASTER_ADDR MASTER_PORT HOSTFILE",
        'if [ "${SLURM_RESTART_COUNT:-0}" != 0 ]; then  # requeued: continue from the newest checkpoint',
        f"  {q(sys.executable)} -m dsrecipes.run.requeue --run-dir {q(str(run_dir))}",
        "fi",
        f"srun --nodes={ln.num_nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {q('exec ' + inner_sh)} &",
        *_REQUEUE_TRAPS,
    ]
    return "\n".join(head + [""] + body) + "\n"


# The batch shell waits for srun in the background, so that its traps run while the ranks train.
_REQUEUE_TRAPS = [
    "SRUN_PID=$!",
    "near_time_limit() {",
    '  echo "time limit near: the ranks checkpoint at the next step boundary, then job $SLURM_JOB_ID is requeued"',
    '  scancel --signal=TERM "$SLURM_JOB_ID"  # every process of the job steps (not this shell)',
    '  wait "$SRUN_PID" || true',
    '  scontrol requeue "$SLURM_JOB_ID"',
    "}",
    "preempted() {",
    '  echo "preempted: the ranks checkpoint at the next step boundary; SLURM requeues the job"',
    '  wait "$SRUN_PID" || true',
    "}",
    "trap near_time_limit USR1",
    "trap preempted TERM",
    "STATUS=0",
    'wait "$SRUN_PID" || STATUS=$?  # returns early when a trap ran; the trap waited for the ranks',
    'exit "$STATUS"',
]
