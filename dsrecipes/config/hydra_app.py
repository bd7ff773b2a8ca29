"""The Hydra application: the one module that touches Hydra's internals (hydra-core 1.3.x `hydra._internal`: the
argument parser, search path, sources registry, runner, callbacks, the basic sweeper's job split, the config loader's
defaults list and repository). Everything else composes through here:

    compose(overrides), hydra_context()   the compose API (validate, show, tests): checked for code, `hydra` dropped
    run(overrides, job_fn)                a single run: composed once, checked for code, handed over as a `Job`
    multirun(overrides, job_fn)           a sweep: every job checked before the first starts and again when Hydra
                                          composes it (guarded loader); each job handed over inside Hydra's job
    informational(args)                   --cfg, --info, --hydra-help, --shell-completion, on our search path

A `Job` carries what differs between a single run and a sweep's job (the run directory's default, whether Hydra made
it, entering Hydra's job: `.hydra/`, callbacks, logging), so both take one road in one order (commands/train.py).
config/safety.py is the rule for what a composition may hold; Hydra supplies the baseline and the file a key came from.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from hydra import compose as hydra_compose
from hydra import version
from hydra._internal.callbacks import Callbacks
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.hydra import Hydra
from hydra._internal.sources_registry import SourcesRegistry
from hydra._internal.utils import create_config_search_path, get_args_parser
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobStatus, configure_log, run_job
from hydra.errors import HydraException
from hydra.types import HydraContext, RunMode
from omegaconf import OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

import dsrecipes.config.cycles as cycles
import dsrecipes.config.recipe_file as recipe_file
import dsrecipes.config.resolvers as resolvers
import dsrecipes.config.safety as safety
import dsrecipes.config.sources as sources
from dsrecipes.config.hints import compose_error
from dsrecipes.config.resolvers import readable_env  # noqa: F401 - tests and callers name it here
from dsrecipes.core.errors import ConfigError, UserError
from dsrecipes.core.paths import conf_dir
from dsrecipes.core.rundir import claim_sweep_dir, refuse_dangling_link, unique_new_dir
from dsrecipes.core.schema import GROUP_SCHEMAS, TrainConfig

CONFIG_NAME = "train"
TASK_NAME = "dsrecipes"
_baselines: Dict[Any, Dict[str, Any]] = {}  # conf/train.yaml alone, per search path and mode (pure data)
_stored: Dict[Tuple[Optional[str], str], Any] = {}  # (group, name) -> the ConfigStore entry register_schemas made


def args_parser() -> Any:
    """Hydra's own command-line parser (commands/args.py turns its usage errors into one message)."""
    return get_args_parser()


def refuse_other_config_roots(args: Any) -> None:
    """Hydra's --config-dir/-path/-name would compose another tree than conf/ (without its schema and rules);
    --experimental-rerun loads a pickle."""
    given = [f"--{n.replace('_', '-')}" for n in ("config_dir", "config_path", "config_name", "experimental_rerun")
             if getattr(args, n) is not None]
    if given:
        raise UserError(f"{', '.join(given)}: not supported by dsrecipes; run a recipe file with "
                        f"`dsrecipes train FILE.yaml` (or recipe=FILE.yaml), or name folders of recipes in "
                        f"{sources.RECIPES_ENV}=DIR[:DIR...]")


# ---------------------------------------------------------------------------------------------------------------
# Hydra on our search path


def register_schemas() -> None:
    """The schemas in Hydra's ConfigStore (once per process: it hands out deep copies; again where an entry is not
    ours) and only the allowed resolvers (config/resolvers.py: `dsr.asset`, `now`, `oc.select`, `oc.env` reading only
    safety.READABLE_ENV), never at import. Enforced where interpolations resolve, whatever form a recipe's text takes."""
    resolvers.install()
    store = ConfigStore.instance()
    entry = lambda key: (store.repo.get(key[0], {}) if key[0] else store.repo).get(f"{key[1]}.yaml")  # noqa: E731
    for group, name, node in [(None, "train_schema", TrainConfig), *(("schema", g, s) for g, s in GROUP_SCHEMAS.items())]:
        if (group, name) not in _stored or entry((group, name)) is not _stored[group, name]:
            store.store(name=name, node=node, group=group)
            _stored[group, name] = entry((group, name))


def search_path() -> Any:
    """Hydra's own configs, the user's recipe folders (before conf/), conf/, recipe files by path, the schemas."""
    for source in sources.SOURCES:
        SourcesRegistry.instance().register(source)  # registering twice is a no-op
    csp = create_config_search_path(str(conf_dir()))
    for folder in sources.user_recipe_dirs():
        csp.prepend(provider="dsrecipes-user", path=sources.folder_source_path(folder),
                    anchor=SearchPathQuery(provider="main"))
    csp.prepend(provider="dsrecipes-file", path=sources.file_source_path(Path.cwd()),
                anchor=SearchPathQuery(provider="schema"))
    return csp


def create_hydra() -> Any:
    """A fresh global Hydra on `search_path()` (what `initialize_config_dir` does, with our sources), version base 1.3."""
    register_schemas()
    version.setbase("1.3")
    GlobalHydra.instance().clear()
    return Hydra.create_main_hydra2(task_name=TASK_NAME, config_search_path=search_path())


@contextlib.contextmanager
def hydra_context(fresh: bool = False) -> Iterator[Any]:
    """Hydra initialised once; compositions inside reuse it (validate --all composes hundreds). `fresh`: a Hydra of
    its own (a run or sweep changes its loader), cleared at the end."""
    resolvers.install()  # (a Hydra initialised elsewhere: still only the allowed resolvers)
    if GlobalHydra.instance().is_initialized() and not fresh:
        yield GlobalHydra.instance().hydra
        return
    try:
        yield create_hydra()
    finally:
        GlobalHydra.instance().clear()


def compose(overrides: Sequence[str] = ()) -> Any:
    """conf/train.yaml with overrides (Hydra's compose API), checked for code with its `hydra` node, which is then
    dropped. Errors: one ConfigError (config/hints.py)."""
    with hydra_context():
        try:
            composed = hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides), return_hydra_config=True)
        except Exception as exc:  # Hydra raises many types; all are user mistakes here
            raise compose_error(exc, overrides) from None
        check(GlobalHydra.instance().config_loader(), overrides, composed, RunMode.RUN)
    with read_write(composed), open_dict(composed):
        del composed["hydra"]
    return composed


# ---------------------------------------------------------------------------------------------------------------
# No code from configuration (config/safety.py): Hydra's side of the check


def check(loader: Any, overrides: Sequence[str], composed: Any, run_mode: Any) -> None:
    """ConfigError naming every key of `composed` that would run code, and the file or override that set it; or a
    defaults entry that names a recipe or climbs out of the config tree with '..' (config/cycles.py)."""
    refused = cycles.included_recipe(overrides) or cycles.climbing_entries(composed, overrides)
    if refused:
        raise ConfigError(refused)
    safety.check(overrides, composed, _baseline(loader, run_mode),
                 lambda path, value: _source(loader, overrides, run_mode, path, value),
                 lambda path, value: _shared_source(loader, overrides, run_mode, path, value))


def _baseline(loader: Any, run_mode: Any) -> Dict[str, Any]:
    key = (tuple((p.provider, p.path) for p in loader.get_search_path().get_path()), str(run_mode))
    if key not in _baselines:
        _baselines[key] = safety.container(loader.load_configuration(config_name=CONFIG_NAME, overrides=[], run_mode=run_mode))
    return _baselines[key]


def _source(loader: Any, overrides: Sequence[str], run_mode: Any, path: Tuple[Any, ...], value: Any) -> str:
    """The last config file of the defaults list that sets `path` to `value`, else the command-line override."""
    found = _setting_file(loader, overrides, run_mode, path, lambda here: value is safety.MISSING or here == value)
    if found is not None:
        return _file_name(*found)
    for ov in OverridesParser.create().parse_overrides(list(overrides)):
        if safety.related(tuple(ov.key_or_group.split(".")), tuple(str(k) for k in path)):
            return f"command-line override '{ov.input_line}'"
    return "the composition"


SHARED_PROVIDERS = ("dsrecipes-user", "dsrecipes-file")  # $DSRECIPES_RECIPES folders, recipe files by path


def _shared_source(loader: Any, overrides: Sequence[str], run_mode: Any, path: Tuple[Any, ...],
                   value: Any) -> Optional[str]:
    """The shared recipe (search_path's SHARED_PROVIDERS) that set `path` to `value`; None when the command line set
    that key (its overrides apply after every file) or a file of the config tree did. Unknown: the composition."""
    dotted = ".".join(str(k) for k in path)
    for ov in OverridesParser.create().parse_overrides(list(overrides)):
        if ov.key_or_group == dotted and not ov.is_delete() and not ov.package:
            return None
    found = _setting_file(loader, overrides, run_mode, path, lambda here: here == value)
    if found is None:
        return "the composition"
    if found[0].provider not in SHARED_PROVIDERS:
        return None
    name = _file_name(*found)
    line = recipe_file.line_of(Path(name), dotted) if os.path.isfile(name) else None
    return f"{name}:{line}" if line else name


def _setting_file(loader: Any, overrides: Sequence[str], run_mode: Any, path: Tuple[Any, ...],
                  matches: Callable[[Any], bool]) -> Optional[Tuple[Any, Any]]:
    """(loaded config, defaults entry) of the last file of the defaults list that sets `path` to a value `matches`
    accepts; None when none does (or the defaults list cannot be computed: naming the source is best effort)."""
    try:
        defaults = loader.compute_defaults_list(CONFIG_NAME, list(overrides), run_mode).defaults
    except Exception:  # noqa: BLE001 - without the defaults list no file can vouch for the value
        return None
    for d in reversed(defaults):
        if (loaded := loader.repository.load_config(d.config_path) if d.config_path else None) is None:
            continue
        here = safety.lookup(safety.container(ConfigLoaderImpl._embed_result_config(loaded, d.package).config), path)
        if here is not safety.MISSING and matches(here):
            return loaded, d
    return None


def _file_name(loaded: Any, default: Any) -> str:
    """The file behind a loaded config: conf/ (`file://DIR`), a recipe folder or a recipe file named by path
    (`scheme://FILE`); Hydra's own packaged configs by their name."""
    where = str(loaded.path)
    rest = where.split("://", 1)[1] if "://" in where else where
    candidate = rest if os.path.isfile(rest) else os.path.join(rest, f"{default.config_path}.yaml")
    name = os.path.realpath(candidate) if os.path.isfile(candidate) else f"{default.config_path} in {where}"
    if default.parent not in (None, "<root>", CONFIG_NAME, default.config_path):
        name += f", pulled in by the defaults list of {default.parent}"
    return name


class GuardedLoader:
    """Hydra's config loader with every composition it returns checked (the sweep's and each job's), so a sweep
    never instantiates or runs an unchecked composition; everything else is Hydra's own loader."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_configuration(self, config_name: str, overrides: List[str], run_mode: Any, **kwargs: Any) -> Any:
        cfg = self._inner.load_configuration(config_name=config_name, overrides=overrides, run_mode=run_mode, **kwargs)
        check(self._inner, overrides, cfg, run_mode)
        return cfg

    def load_sweep_config(self, master_config: Any, sweep_overrides: List[str]) -> Any:
        cfg = self._inner.load_sweep_config(master_config, sweep_overrides)
        check(self._inner, _texts(master_config.hydra.overrides.hydra) + list(sweep_overrides), cfg, RunMode.RUN)
        return cfg


def check_sweep(loader: GuardedLoader, overrides: Sequence[str]) -> List[List[str]]:
    """Compose and check the sweep and every job of it (as Hydra's basic sweeper will split it) before anything of
    the sweep exists; its jobs' overrides. Other composition errors are left to Hydra and the jobs."""
    try:
        master = loader.load_configuration(config_name=CONFIG_NAME, overrides=list(overrides),
                                           run_mode=RunMode.MULTIRUN)
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(_texts(master.hydra.overrides.task))
        batches = BasicSweeper.split_arguments(parsed, None)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - Hydra reports its own composition errors when the sweep starts
        return []
    for job in (jobs := [list(job) for batch in batches for job in batch]):
        try:
            loader.load_sweep_config(master, job)
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - a job that cannot be composed fails on its own, as before
            continue
    return jobs


# ---------------------------------------------------------------------------------------------------------------
# Runs and sweeps


@dataclass
class Job:
    """One run as Hydra hands it over: a single run (Hydra's job not entered yet) or a sweep's job (inside it)."""

    composed: Any  # the checked composition, `hydra` node included (load_config skips it)
    overrides: List[str]  # the task overrides (blame in messages, the closing summary)
    sweep: bool
    hydra: Any = None  # a single run: the Hydra that enters the job

    @property
    def job_dir(self) -> Optional[Path]:
        """A sweep's job directory (made by Hydra); None for a single run (nothing exists before the claim)."""
        return Path(HydraConfig.get().runtime.output_dir) if self.sweep else None

    def run_dir(self, output_dir: Optional[str]) -> Tuple[Path, str]:
        """(run directory, the setting that names it): `trainer.output_dir` wins; else Hydra's job directory (a
        sweep), or a new directory from `hydra.run.dir` (a single run: `-1`, `-2` appended when it exists, unless
        hydra.run.dir was given)."""
        if output_dir:  # (a dangling link was refused by run/preflight.py with the other path checks)
            return Path(output_dir).expanduser().resolve(), "trainer.output_dir"
        if self.sweep:
            return self.job_dir.resolve(), "hydra.sweep.dir"
        HydraConfig.instance().set_config(self.composed)  # the pattern may use ${hydra:...}
        pattern = Path(str(self.composed.hydra.run.dir)).expanduser()
        refuse_dangling_link(pattern, "hydra.run.dir")  # resolve() would name the link's missing target, and claim make it
        given = any(ov.split("=", 1)[0].lstrip("+~") == "hydra.run.dir" for ov in _texts(self.composed.hydra.overrides.hydra))
        return (pattern if given else unique_new_dir(pattern)).resolve(), "hydra.run.dir"

    def hydra_made(self, run_dir: Path) -> bool:
        """Hydra has written its `.hydra/` into `run_dir` already (a sweep's own job directory)."""
        return self.sweep and run_dir == self.job_dir.resolve()

    def enter(self, run_dir: Path, body: Callable[[], None]) -> None:
        """Run `body` as Hydra's job in the claimed `run_dir`: writes `.hydra/`, runs the callbacks, configures the
        job's logging (Hydra.run minus its second compose; a sweep's job is in Hydra's already); raises what it raised."""
        if self.sweep:
            body()
            return
        with read_write(self.composed.hydra.run):
            self.composed.hydra.run.dir = str(run_dir)
        callbacks = Callbacks(self.composed)
        callbacks.on_run_start(config=self.composed, config_name=CONFIG_NAME)
        ret = run_job(hydra_context=HydraContext(config_loader=self.hydra.config_loader, callbacks=callbacks),
                      task_function=lambda _: body(), config=self.composed, job_dir_key="hydra.run.dir",
                      job_subdir_key=None, configure_logging=True)
        callbacks.on_run_end(config=self.composed, config_name=CONFIG_NAME, job_return=ret)
        if ret.status is JobStatus.FAILED:  # a bug, not a user error: raised as it is (Hydra's ret.return_value
            raise ret._return_value  # also writes 'Error executing job with overrides: [...]' to stderr)


def run(overrides: Sequence[str], job_fn: Callable[[Job], None]) -> None:
    """A single run: compose once (checked for code before Hydra configures logging from it), hand it over."""
    with hydra_context(fresh=True) as hydra:
        composed = _compose_checked(hydra, overrides)
        composed.hydra.mode = RunMode.RUN
        job_fn(Job(composed, _texts(composed.hydra.overrides.task), sweep=False, hydra=hydra))


def multirun(overrides: Sequence[str], job_fn: Callable[[Job], None], same_jobs: Callable[..., None]) -> None:
    """Hydra's multirun, every composition checked for code: the sweep's and each job's up front (nothing of it exists
    yet; a named hydra.sweep.dir's earlier jobs: `same_jobs(dir, jobs)`), each again as Hydra composes it."""
    with hydra_context(fresh=True) as hydra:
        hydra.config_loader = GuardedLoader(hydra.config_loader)
        task = lambda composed: job_fn(Job(composed, _texts(HydraConfig.get().overrides.task), sweep=True))
        claimed = _unique_sweep_dir(hydra, overrides, check_sweep(hydra.config_loader, overrides), same_jobs)
        try:
            hydra.multirun(config_name=CONFIG_NAME, task_function=task, overrides=claimed)
        except (HydraException, OmegaConfBaseException) as exc:  # the sweeper composes every job before running any
            raise compose_error(exc, overrides) from None


def informational(args: Any) -> bool:
    """--cfg, --info, --hydra-help, --shell-completion: what Hydra's own runner does, on our search path. False when
    none was asked for."""
    if not (args.hydra_help or args.cfg or args.info or args.shell_completion):
        return False
    overrides = list(args.overrides)
    with hydra_context(fresh=True) as hydra:
        if not args.shell_completion:  # Hydra composes (and may configure logging) from these: checked first
            _compose_checked(hydra, overrides, configure_logging=False)
        try:
            if args.hydra_help:
                hydra.hydra_help(config_name=CONFIG_NAME, args_parser=get_args_parser(), args=args)
            elif args.cfg:
                hydra.show_cfg(config_name=CONFIG_NAME, overrides=overrides, cfg_type=args.cfg, package=args.package,
                               resolve=args.resolve)
            elif args.info:
                hydra.show_info(args.info, config_name=CONFIG_NAME, overrides=overrides)
            else:
                hydra.shell_completion(config_name=CONFIG_NAME, overrides=overrides)
        except (HydraException, OmegaConfBaseException) as exc:
            raise compose_error(exc, overrides) from None
    return True


def _compose_checked(hydra: Any, overrides: Sequence[str], configure_logging: bool = True) -> Any:
    """One composition, checked for code (config/safety.py) before Hydra configures logging from it."""
    try:
        composed = hydra.compose_config(config_name=CONFIG_NAME, overrides=list(overrides), run_mode=RunMode.RUN)
    except Exception as exc:  # Hydra raises many types; all are user mistakes in a composition
        raise compose_error(exc, overrides) from None
    check(hydra.config_loader, overrides, composed, RunMode.RUN)
    if configure_logging:
        configure_log(composed.hydra.hydra_logging, composed.hydra.verbose)
    return composed


def _texts(recorded: Any) -> List[str]:
    """Hydra's record of the overrides, as the text typed: never resolved (an override's `${...}` resolves where the
    value is used, through config/resolvers.py, not while its text is read)."""
    return [str(o) for o in OmegaConf.to_container(recorded, resolve=False)]


def _unique_sweep_dir(hydra: Any, overrides: Sequence[str], jobs: List[List[str]], same_jobs: Callable) -> List[str]:
    """The sweep directory, claimed before Hydra writes into it (rundir.claim_sweep_dir): the one hydra.sweep.dir
    names, or Hydra's default (a date and a time) made unique per invocation (check_sweep checked the composition)."""
    try:
        composed = hydra.compose_config(config_name=CONFIG_NAME, overrides=list(overrides),
                                        run_mode=RunMode.MULTIRUN, with_log_configuration=False)
    except Exception as exc:  # Hydra raises many types; all are user mistakes in a composition
        raise compose_error(exc, overrides) from None
    if any(ov.split("=", 1)[0].lstrip("+~") == "hydra.sweep.dir" for ov in overrides):
        named = Path(str(composed.hydra.sweep.dir)).expanduser()
        refuse_dangling_link(named, "hydra.sweep.dir")  # resolve() would name the link's missing target
        same_jobs(claim_sweep_dir(named.resolve()), jobs)
        return list(overrides)
    new = str(claim_sweep_dir(unique_new_dir(Path(str(composed.hydra.sweep.dir)))))
    return list(overrides) + ["hydra.sweep.dir='" + new.replace("\\", "\\\\").replace("'", "\\'") + "'"]
