"""`dsrecipes [train] [overrides]`: one run, or a sweep (`-m`) of runs, every run through `run_job` in one order:

    validate (load_config) -> check the machine (entry.check_machine) -> claim the run directory (rundir.claim)
    -> decide (entry.decide: resume point, data identity) -> Hydra's job (.hydra/, callbacks, logging)
    -> plan, write, launch (entry.run) -> result.json and the closing summary (commands/outcome.py, report.py)

A failure before the launch leaves nothing behind in a single run (exit 2: no directory made before the claim,
nothing written into the claimed one); a sweep's job records it for the sweep's table instead (result.json in
Hydra's job directory before the claim, in the claimed run directory after it; a refusal leaves a directory as it
was) and the sweep goes on. Hydra itself (compositions checked for code, the runner, the sweeper) is
config/hydra_app.py; `--help` is ours (commands/help.py), `--cfg`, `--info`, `--hydra-help` are Hydra's.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Set

import dsrecipes.config.hydra_app as hydra_app
from dsrecipes.commands.args import parse
from dsrecipes.commands.help import train_help, version_text
from dsrecipes.commands.outcome import conclude, report_interrupted, say
from dsrecipes.config.load import load_config
from dsrecipes.core import failure, stopping
from dsrecipes.core.console import log_path, quiet_third_party
from dsrecipes.core.errors import NothingToTrain, Refused, UserError
from dsrecipes.core.rundir import claim, write_result
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.typed import config_to_dict
from dsrecipes.observe.report import closing_summary
from dsrecipes.observe.sweep import FINISHED_EARLIER, refuse_other_jobs
from dsrecipes.run.entry import Decision, check_machine, decide, run, with_run_dir
from dsrecipes.run.resume_contract import identity_fingerprint


@dataclass
class Invocation:
    """This command's state: what it was asked and how its runs went (one per `main`, never global)."""

    argv: List[str]  # the overrides as typed (the resume command repeats them)
    sweep: bool
    exit_code: int = 0
    interrupted: bool = False  # a stop signal ends the sweep, not only its current job
    run_dirs: Set[Path] = field(default_factory=set)
    jobs: int = 0  # runs this invocation was handed
    done_earlier: List[Path] = field(default_factory=list)  # a sweep's jobs that had finished before it (skipped)

    def failed(self, code: int) -> None:
        self.exit_code = self.exit_code or code


def main(argv: List[str]) -> int:
    if "--version" in argv:  # Hydra's parser would print Hydra's version
        print(version_text())
        return 0
    args = parse(hydra_app.args_parser(), argv)
    if args.help:
        print(train_help())
        return 0
    hydra_app.refuse_other_config_roots(args)
    inv = Invocation(recipe_files_as_overrides(args.overrides), bool(args.multirun))
    if hydra_app.informational(args):
        return 0
    if inv.sweep:  # (a hydra.sweep.dir of an earlier sweep: its jobs must be this sweep's, refuse_other_jobs)
        hydra_app.multirun(inv.argv, lambda job: sweep_job(inv, job), refuse_other_jobs)
    else:
        hydra_app.run(inv.argv, lambda job: run_job(inv, job))
    if inv.done_earlier and len(inv.done_earlier) == inv.jobs and not inv.exit_code:  # as a single run would be
        say(f"error: nothing to train: every job of this sweep ({len(inv.done_earlier)}) had finished before this "
            "run of it and none was run again; raise trainer.max_steps (or trainer.epochs) to train them further, "
            "or choose a new hydra.sweep.dir for a new sweep; nothing was changed")
        return 2
    return inv.exit_code


def recipe_files_as_overrides(words: List[str]) -> List[str]:
    """`dsrecipes train my.yaml` (LLaMA-Factory's habit) is `recipe=my.yaml`: a word without `=` naming a YAML file."""
    files = [w for w in words if "=" not in w and w.endswith((".yaml", ".yml"))]
    if len(files) > 1:
        raise UserError(f"one recipe file per run, got {', '.join(files)}; put what they share into one file, or "
                        "sweep over files with -m recipe=a.yaml,b.yaml")
    return [f"recipe={w if w.startswith(('/', '.', '~')) else './' + w}" if w in files else w for w in words]


def sweep_job(inv: Invocation, job: hydra_app.Job) -> Optional[str]:
    """A sweep's job; what it returns reaches the sweep's table (observe/sweep.SweepSummary, through Hydra's job
    return): FINISHED_EARLIER when it was skipped, having finished before this run of the sweep (done_earlier)."""
    skipped = len(inv.done_earlier)
    run_job(inv, job)
    return FINISHED_EARLIER if len(inv.done_earlier) > skipped else None


def run_job(inv: Invocation, job: hydra_app.Job) -> None:
    """One run, single or a sweep's job, in the one order (see the module's opening comment)."""
    if inv.interrupted:
        print(f"skipped (the sweep was interrupted): {job.job_dir}", file=sys.stderr)
        return
    started, inv.jobs = time.perf_counter(), inv.jobs + 1
    try:
        cfg = check_machine(load_config(job.composed, overrides=job.overrides))
    except UserError as exc:
        return _refused(inv, exc, job.job_dir)
    run_dir, key = job.run_dir(cfg.trainer.output_dir)
    cfg = with_run_dir(cfg, run_dir)
    try:
        if run_dir in inv.run_dirs:
            raise UserError(f"trainer.output_dir: {run_dir} is already the directory of an earlier job of this sweep; "
                            "each job needs its own (leave trainer.output_dir unset in sweeps)")
        inv.run_dirs.add(run_dir)
        held = claim(run_dir, key, identity_fingerprint(config_to_dict(cfg)), hydra_job_dir=job.hydra_made(run_dir))
    except UserError as exc:
        return _refused(inv, exc, None)  # nothing is written into a directory we do not hold
    with held:
        quiet_third_party(log_path(run_dir, "main"))  # our directory now; before deepspeed/transformers are imported
        try:
            decision = decide(cfg, overrides=job.overrides)  # keys the command names stay its own (legacy_keys)
        except UserError as exc:
            if not inv.sweep or isinstance(exc, Refused):  # nothing is recorded: a new directory goes again
                held.undo()
            return _refused(inv, exc, run_dir)
        job.enter(run_dir, lambda: _launch(inv, job, cfg, decision, started))


def _launch(inv: Invocation, job: hydra_app.Job, cfg: TrainConfig, decision: Decision, started: float) -> None:
    """Inside Hydra's job: launch and write result.json (also for failures)."""
    run_dir = Path(cfg.trainer.output_dir)
    stopping.reset()
    try:
        code = run(cfg, decision)
    except UserError as exc:
        return _record(inv, exc, run_dir)
    except KeyboardInterrupt as exc:  # Ctrl-C twice, or a stop signal before the launch (preparing data)
        report_interrupted(run_dir, stopping.signal_of(exc), {}, inv.argv)
        exc.said = True  # with its resume command: cli.run_guarded adds no bare 'interrupted'
        raise
    except Exception as exc:  # noqa: BLE001 - a crash: recorded; a sweep goes on (its line said here, its
        write_result(run_dir, 1, failure.one_line(exc))  # traceback in the job's log), a single run re-raises
        if not inv.sweep:  # (cli.console_main says it the same way)
            raise
        print(f"error: {failure.crash_line(exc, log_path(run_dir, 'main'))}", file=sys.stderr, flush=True)
        return inv.failed(1)
    code, interrupted = conclude(run_dir, code, cfg.launcher.dry_run, inv.argv)
    inv.interrupted = inv.interrupted or interrupted
    inv.failed(code)
    if code == 0 and not cfg.launcher.dry_run:
        print(closing_summary(run_dir, time.perf_counter() - started, job.overrides, cfg.trainer.max_steps,
                              cfg.trainer.epochs), flush=True)


def _refused(inv: Invocation, exc: UserError, record_in: Optional[Path]) -> None:
    """A run that cannot start: a single run raises (exit 2); a sweep records it and goes on with the next job."""
    if not inv.sweep:
        raise exc
    _record(inv, exc, record_in)


def _record(inv: Invocation, exc: UserError, record_in: Optional[Path]) -> None:
    if inv.sweep and isinstance(exc, NothingToTrain):  # a job of an earlier run of this sweep: skipped, not failed
        inv.done_earlier.append(record_in)  # (its result.json stands; sweep_job tells the table)
        text = exc.render().removeprefix("error: ")
        return print(f"skipped (finished before this run of the sweep): {text}", file=sys.stderr, flush=True)
    say(exc.render())  # (a pipeline's stage: said once, by the pipeline, with the stage)
    if record_in is not None and not isinstance(exc, Refused):  # a refused run leaves its directory as it was
        write_result(record_in, exc.exit_code, exc.render())
    inv.failed(exc.exit_code)
