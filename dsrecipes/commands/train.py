"""`python -m dsrecipes [overrides]` / `dsrecipes train`: the Hydra app that composes once, then runs.

Hydra's own `@hydra.main` composes a single run twice (once to read `hydra.mode`, once to run) and reports a bad
override with its traceback-style text and exit 1. This runner drives Hydra's classes directly (hydra-core is
pinned to 1.3.x): a single run is composed exactly once, validated by `load_config()` (one message, exit 2, before
any output directory exists), and then run as a Hydra job (`run_job`: run directory, `.hydra/`, callbacks) with the
already typed config. `-m` sweeps go through Hydra's sweeper, each job validating its own composition. `--help` is
dsrecipes' own (commands/help.py); `--cfg`, `--info` and `--hydra-help` are Hydra's, on dsrecipes' search path.

Run directories: a single run's directory is `trainer.output_dir` when set (Hydra's job files go there too), else
Hydra's `hydra.run.dir` pattern made unique by an atomic mkdir (two runs started in the same second get two
directories; likewise a sweep's `hydra.sweep.dir`). It is claimed (rundir.claim: owned, locked) before Hydra or
dsrecipes writes anything into it, and held until result.json is written. A run stopped by SIGTERM/SIGINT ends
with status `interrupted` and prints the command that resumes it.

No code from configuration (config/safety.py): every composition, the sweep's and each of its jobs' included, is
checked before Hydra instantiates its callbacks or configures logging from it; a sweep checks all its jobs before
the first one starts (and Hydra's loader stays guarded while it runs). Flags that bring in other config trees or
pickles (`--config-dir`, `--config-path`, `--config-name`, `--experimental-rerun`) are refused.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence

from dsrecipes.config.load import compose_error, config_to_dict, load_config, register_schemas
from dsrecipes.config.schema import TrainConfig
from dsrecipes.errors import UserError

CONFIG_NAME = "train"
TASK_NAME = "dsrecipes"


class _Outcome:
    exit_code = 0
    interrupted = False
    argv: List[str] = []
    sweep_dirs: set = set()  # the overrides of this invocation (for the resume command)


def main(argv: List[str]) -> int:
    from hydra._internal.utils import get_args_parser

    from dsrecipes.commands.args import parse
    from dsrecipes.commands.help import train_help, version_text

    if "--version" in argv:  # Hydra's parser would print Hydra's version
        print(version_text())
        return 0
    parser = get_args_parser()
    args = parse(parser, argv)
    if args.help:
        print(train_help())
        return 0
    _refuse_other_config_roots(args)
    register_schemas()
    _Outcome.exit_code = 0
    _Outcome.interrupted = False
    _Outcome.sweep_dirs = set()
    _Outcome.argv = list(args.overrides)
    if args.hydra_help or args.cfg or args.info or args.shell_completion:
        _with_hydra(lambda hydra: _informational(hydra, parser, args))
    elif args.multirun:
        _with_hydra(lambda hydra: _multirun(hydra, list(args.overrides)))
    else:
        _with_hydra(lambda hydra: _run_once(hydra, list(args.overrides)))
    return _Outcome.exit_code


def _refuse_other_config_roots(args: Any) -> None:
    """Hydra's --config-dir/--config-path/--config-name would compose from another tree than conf/ (without its
    schema and rules); user recipes have their own road (config/sources.py)."""
    from dsrecipes.config.sources import RECIPES_ENV

    given = [flag for flag, value in (("--config-dir", args.config_dir), ("--config-path", args.config_path),
                                      ("--config-name", args.config_name),
                                      ("--experimental-rerun", args.experimental_rerun)) if value is not None]
    if given:
        raise UserError(f"{', '.join(given)}: not supported by dsrecipes; run a recipe file with "
                        f"recipe=/path/to/file.yaml, or name folders of recipes in {RECIPES_ENV}=DIR[:DIR...]")


def _multirun(hydra: Any, overrides: List[str]) -> None:
    """Hydra's multirun with every composition checked for code: the sweep's and each job's up front (nothing of the
    sweep exists yet), and each again when Hydra composes it (the loader is guarded)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dsrecipes.config import safety

    hydra.config_loader = safety.GuardedLoader(hydra.config_loader, CONFIG_NAME)
    safety.check_sweep(hydra.config_loader, CONFIG_NAME, overrides)
    try:
        hydra.multirun(config_name=CONFIG_NAME, task_function=_job, overrides=_unique_sweep_dir(hydra, overrides))
    except (HydraException, OmegaConfBaseException) as exc:  # the sweeper composes every job before running any
        raise compose_error(exc, overrides) from None


def _with_hydra(body: Any) -> Any:
    from hydra.core.global_hydra import GlobalHydra

    from dsrecipes.config.sources import create_hydra

    hydra = create_hydra(TASK_NAME)
    try:
        return body(hydra)
    finally:
        GlobalHydra.instance().clear()


def _compose(hydra: Any, overrides: List[str], configure_logging: bool = True) -> Any:
    """One composition, checked for code (config/safety.py) before Hydra configures logging from it."""
    from hydra.core.utils import configure_log
    from hydra.types import RunMode

    from dsrecipes.config import safety

    try:
        composed = hydra.compose_config(config_name=CONFIG_NAME, overrides=overrides, run_mode=RunMode.RUN)
    except Exception as exc:  # Hydra raises many types; all are user mistakes in a composition
        raise compose_error(exc, overrides) from None
    safety.check(hydra.config_loader, CONFIG_NAME, overrides, composed, RunMode.RUN)
    if configure_logging:
        configure_log(composed.hydra.hydra_logging, composed.hydra.verbose)
    return composed


def _overridden(overrides: Sequence[str], key: str) -> bool:
    return any(ov.split("=", 1)[0].lstrip("+~") == key for ov in overrides)


def _quoted(path: Path) -> str:
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _unique_sweep_dir(hydra: Any, overrides: List[str]) -> List[str]:
    """Hydra's default sweep directory (a date and a time) made unique per invocation (the sweep's composition
    was checked by safety.check_sweep already)."""
    from hydra.types import RunMode

    from dsrecipes.rundir import unique_new_dir

    if _overridden(overrides, "hydra.sweep.dir"):
        return overrides
    try:
        composed = hydra.compose_config(config_name=CONFIG_NAME, overrides=overrides, run_mode=RunMode.MULTIRUN,
                                        with_log_configuration=False)
    except Exception as exc:  # Hydra raises many types; all are user mistakes in a composition
        raise compose_error(exc, overrides) from None
    return overrides + [f"hydra.sweep.dir={_quoted(unique_new_dir(Path(str(composed.hydra.sweep.dir))))}"]


def _run_once(hydra: Any, overrides: List[str]) -> None:
    """One composition, one validation, one claimed run directory, one Hydra job (what `Hydra.run` does, minus its
    second compose)."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import run_job
    from hydra.types import HydraContext, RunMode

    from dsrecipes.entry import check_machine, decide, with_run_dir
    from dsrecipes.resume_contract import identity_fingerprint
    from dsrecipes.rundir import claim

    composed = _compose(hydra, overrides)
    cfg = load_config(composed, overrides=overrides)  # exit 2 here: no run directory is created
    composed.hydra.mode = RunMode.RUN
    cfg = check_machine(cfg)
    run_dir, key = _single_run_dir(composed, cfg, overrides)
    cfg = with_run_dir(cfg, run_dir)
    started = time.perf_counter()
    with claim(run_dir, key, identity_fingerprint(config_to_dict(cfg))):  # exit 2 here: nothing touched
        _quiet(run_dir)  # before deepspeed and transformers are imported
        decision = decide(cfg)  # exit 2 here (a resume the checkpoint cannot take): nothing written, not .hydra/
        callbacks = Callbacks(composed)
        callbacks.on_run_start(config=composed, config_name=CONFIG_NAME)
        ret = run_job(hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=callbacks),
                      task_function=lambda _: _run_claimed(cfg, run_dir, False, started, decision), config=composed,
                      job_dir_key="hydra.run.dir", job_subdir_key=None, configure_logging=True)
        callbacks.on_run_end(config=composed, config_name=CONFIG_NAME, job_return=ret)
    _ = ret.return_value  # re-raises what the job raised (a bug, not a user error)


def _single_run_dir(composed: Any, cfg: TrainConfig, overrides: List[str]) -> tuple:
    """(run directory, the setting that names it). Hydra's job directory becomes the run directory (with
    trainer.output_dir set, hydra.run.dir is ignored), so `.hydra/` lands inside the claimed directory only."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import read_write

    from dsrecipes.rundir import unique_new_dir

    if cfg.trainer.output_dir:
        run_dir, key = Path(cfg.trainer.output_dir).expanduser().resolve(), "trainer.output_dir"
    else:
        HydraConfig.instance().set_config(composed)  # the pattern may use ${hydra:...}
        pattern = Path(str(composed.hydra.run.dir)).expanduser()
        if _overridden(overrides, "hydra.run.dir"):
            run_dir, key = pattern.resolve(), "hydra.run.dir"
        else:
            run_dir, key = unique_new_dir(pattern).resolve(), "hydra.run.dir"
    with read_write(composed.hydra.run):
        composed.hydra.run.dir = str(run_dir)
    return run_dir, key


def _informational(hydra: Any, parser: Any, args: Any) -> None:
    """--cfg, --info, --hydra-help, --shell-completion: what Hydra's own runner does, on our search path."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(args.overrides)
    if not args.shell_completion:  # Hydra composes (and may configure logging) from these: checked first
        _compose(hydra, overrides, configure_logging=False)
    try:
        if args.hydra_help:
            hydra.hydra_help(config_name=CONFIG_NAME, args_parser=parser, args=args)
        elif args.cfg:
            hydra.show_cfg(config_name=CONFIG_NAME, overrides=overrides, cfg_type=args.cfg, package=args.package,
                           resolve=args.resolve)
        elif args.info:
            hydra.show_info(args.info, config_name=CONFIG_NAME, overrides=overrides)
        else:
            hydra.shell_completion(config_name=CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise compose_error(exc, overrides) from None


def _job(composed: Any) -> None:
    """A job of a sweep: validate its own composition, then run it like a single run."""
    from hydra.core.hydra_config import HydraConfig

    if _Outcome.interrupted:  # a stop signal ends the sweep, not only its current job
        print(f"skipped (the sweep was interrupted): {HydraConfig.get().runtime.output_dir}", file=sys.stderr)
        return
    try:
        cfg: Optional[TrainConfig] = load_config(composed, overrides=list(HydraConfig.get().overrides.task))
    except UserError as exc:
        _report(Path(HydraConfig.get().runtime.output_dir), exc)
        return
    _run_job(cfg)


def _run_job(cfg: TrainConfig) -> None:
    """Run one validated job of a sweep in its run directory, claimed here. A failure is reported (result.json),
    never raised to Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from dsrecipes.entry import check_machine, with_run_dir
    from dsrecipes.resume_contract import identity_fingerprint
    from dsrecipes.rundir import claim

    started = time.perf_counter()
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir)
    cfg = with_run_dir(cfg, job_dir)
    run_dir = Path(cfg.trainer.output_dir)
    try:
        if run_dir in _Outcome.sweep_dirs:
            raise UserError(f"trainer.output_dir: {run_dir} is already the directory of an earlier job of this sweep; "
                            "each job needs its own (leave trainer.output_dir unset in sweeps)")
        _Outcome.sweep_dirs.add(run_dir)
        held = claim(run_dir, "trainer.output_dir", identity_fingerprint(config_to_dict(cfg)),
                     hydra_job_dir=run_dir == job_dir.resolve())
    except UserError as exc:
        print(exc.render(), file=sys.stderr)  # nothing is written into a directory we do not hold
        _Outcome.exit_code = _Outcome.exit_code or exc.exit_code
        return
    with held:
        _quiet(run_dir)
        try:
            cfg = check_machine(cfg)  # in the claimed job directory: the sweep's summary shows why the job failed
        except UserError as exc:
            _report(run_dir, exc)
            return
        _run_claimed(cfg, run_dir, hc.mode is RunMode.MULTIRUN, started)


def _quiet(run_dir: Path) -> None:
    """Third-party noise of this process to <run>/logs/main.log: only once the directory is ours (the log file is
    created lazily, at the first noisy line)."""
    from dsrecipes.console import log_path, quiet_third_party

    quiet_third_party(log_path(run_dir, "main"))


def _run_claimed(cfg: TrainConfig, run_dir: Path, multirun: bool, started: float, decision: Any = None) -> None:
    """Run in a claimed directory and write result.json (also for failures; not for a refused run)."""
    from hydra.core.hydra_config import HydraConfig

    import dsrecipes.stopping as stopping
    from dsrecipes.commands.outcome import report_interrupted
    from dsrecipes.entry import run
    from dsrecipes.rundir import read_outcome, write_result

    stopping.reset()
    try:
        code = run(cfg, decision)
    except UserError as exc:
        _report(run_dir, exc)
        return
    except KeyboardInterrupt:  # Ctrl-C twice: stopped where it stood
        report_interrupted(run_dir, signal.SIGINT, {}, _Outcome.argv)
        raise
    except Exception as exc:  # noqa: BLE001 - a sweep must go on; a single run re-raises
        if not multirun:
            raise
        import traceback

        traceback.print_exc()
        write_result(run_dir, 1, f"{type(exc).__name__}: {exc}")
        _Outcome.exit_code = _Outcome.exit_code or 1
        return
    outcome = read_outcome(run_dir) or {}
    extra = {k: v for k, v in outcome.items() if k not in ("status", "error", "signal")}
    signum = stopping.requested() or outcome.get("signal")
    if outcome.get("status") == "ok":  # the ranks finished (a signal that came during the last step changes nothing)
        code = 0
    if signum is not None and code != 0:
        code = report_interrupted(run_dir, int(signum), extra, _Outcome.argv)
        _Outcome.interrupted = True  # a sweep stops too
    elif code != 0:
        write_result(run_dir, code, outcome.get("error") or f"ranks exited with code {code}", **extra)
    else:
        write_result(run_dir, 0, None, "dry_run" if cfg.launcher.dry_run else "ok", **extra)
    _Outcome.exit_code = _Outcome.exit_code or code
    if code == 0 and not cfg.launcher.dry_run:
        from dsrecipes.report import closing_summary

        overrides = list(HydraConfig.get().overrides.task)
        print(closing_summary(run_dir, time.perf_counter() - started, overrides, cfg.trainer.max_steps), flush=True)


def _report(run_dir: Path, exc: UserError) -> None:
    from dsrecipes.errors import Refused
    from dsrecipes.rundir import write_result

    print(exc.render(), file=sys.stderr)
    if not isinstance(exc, Refused):  # a refused run leaves the directory exactly as it was
        write_result(run_dir, exc.exit_code, exc.render())
    _Outcome.exit_code = _Outcome.exit_code or exc.exit_code
