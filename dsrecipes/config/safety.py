"""No code from configuration: what a composition may hold that Hydra or Python's logging would execute.

Hydra instantiates every `_target_` under `hydra.callbacks` (and its launcher and sweeper), hands
`hydra.job_logging` / `hydra.hydra_logging` to `logging.config` (handler classes, `()` factories, files opened for
writing), exports `hydra.job.env_set` before a job and reads extra config directories from `hydra.searchpath`. The
only such entries a dsrecipes composition may hold are the ones conf/train.yaml and Hydra's own config files put
there: the sweep callback (`dsrecipes.sweep.SweepSummary`), Hydra's basic launcher and sweeper, and no logging. So,
before anything is instantiated and before Hydra configures logging (`check`):
  * a command-line override may touch `hydra` only at ALLOWED_HYDRA_KEYS (run and sweep directories, verbosity):
    never a `hydra/...` group, an `@hydra` package, callbacks, logging, launcher, sweeper, search path or env;
  * the composed `hydra` node must equal the one conf/train.yaml alone composes (the baseline), apart from those
    keys and the fields Hydra fills in for each composition (RUNTIME_KEYS);
  * no `_target_` or `()` key anywhere that the baseline does not hold at the same place with the same value.
A refusal (ConfigError, exit 2) names where the key came from: the file (recipe or group file) found through Hydra's
defaults list, or the command-line override.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Sequence, Tuple

from dsrecipes.errors import ConfigError

ALLOWED_HYDRA_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "hydra.verbose")
RUNTIME_KEYS = ("runtime", "overrides", "mode", "job.override_dirname", "job.id", "job.num", "job.name",
                "job.config_name")
CODE_KEYS = ("_target_", "()")  # Hydra's instantiate, logging.config's factories
Path = Tuple[Any, ...]
_MISSING = object()
_baselines: Dict[Any, Dict[str, Any]] = {}


def check(loader: Any, config_name: str, overrides: Sequence[str], composed: Any, run_mode: Any) -> None:
    """ConfigError naming every key of `composed` (a composition with its `hydra` node) that would run code."""
    problems = override_problems(overrides)
    if not problems:
        for path, what in composition_problems(loader, config_name, composed, run_mode):
            source = _source(loader, config_name, overrides, run_mode, path, _lookup(_container(composed), path))
            problems.append(f"{_dotted(path)}: {what}, set by {source}; recipes, group files and overrides are data: "
                            "they cannot name code or change Hydra's callbacks, logging, launcher or environment")
    if problems:
        raise ConfigError(problems)


def override_problems(overrides: Sequence[str]) -> List[str]:
    """Command-line overrides that reach into Hydra's own configuration beyond ALLOWED_HYDRA_KEYS."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    problems = []
    for ov in OverridesParser.create().parse_overrides(list(overrides)):
        key, package = ov.key_or_group, ov.package or ""
        touches = key == "hydra" or key.startswith(("hydra.", "hydra/")) or package.split(".")[0] == "hydra"
        if touches and not (key in ALLOWED_HYDRA_KEYS and not package and not ov.is_delete()):
            problems.append(f"command-line override '{ov.input_line}': Hydra's own settings are closed to the command "
                            f"line except {', '.join(ALLOWED_HYDRA_KEYS)} (callbacks, logging, launcher, sweeper, "
                            "search path and environment would run or load code)")
    return problems


def composition_problems(loader: Any, config_name: str, composed: Any, run_mode: Any) -> List[Tuple[Path, str]]:
    """(key path, what is wrong) for each code key and each change to the `hydra` node that the baseline lacks."""
    data = _container(composed)
    base = _baseline(loader, config_name, run_mode)
    found: List[Tuple[Path, str]] = []
    for path, value in _code_keys(data):
        if _lookup(base, path) != value:
            found.append((path, f"names code to run ({value!r})"))
    for path in _differences(data.get("hydra"), base.get("hydra"), ("hydra",)):
        if _allowed(path) or any(_related(path[:2], p[:2]) for p, _ in found):
            continue  # one problem per part of the hydra node (callbacks, job_logging, job, ...)
        found.append((path, "changes Hydra's own configuration"))
    return found


# ---------------------------------------------------------------------------------------------------------------
# The baseline and the comparison


def _baseline(loader: Any, config_name: str, run_mode: Any) -> Dict[str, Any]:
    """conf/<config_name>.yaml composed alone (cached per config search path and mode)."""
    key = (tuple((p.provider, p.path) for p in loader.get_search_path().get_path()), config_name, str(run_mode))
    if key not in _baselines:
        _baselines[key] = _container(loader.load_configuration(config_name=config_name, overrides=[], run_mode=run_mode))
    return _baselines[key]


def _container(cfg: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg


def _code_keys(value: Any, path: Path = ()) -> Iterator[Tuple[Path, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            if k in CODE_KEYS:
                yield path + (k,), v
            yield from _code_keys(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _code_keys(v, path + (i,))


def _differences(a: Any, b: Any, path: Path) -> Iterator[Path]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                yield path + (k,)
            else:
                yield from _differences(a[k], b[k], path + (k,))
    elif a != b:
        yield path


def _allowed(path: Path) -> bool:
    dotted = _dotted(path)
    keys = ALLOWED_HYDRA_KEYS + tuple(f"hydra.{k}" for k in RUNTIME_KEYS)
    return any(dotted == k or dotted.startswith(k + ".") for k in keys)


def _related(a: Path, b: Path) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _lookup(value: Any, path: Path) -> Any:
    for k in path:
        if isinstance(value, dict) and k in value:
            value = value[k]
        elif isinstance(value, list) and isinstance(k, int) and 0 <= k < len(value):
            value = value[k]
        else:
            return _MISSING
    return value


def _dotted(path: Path) -> str:
    return ".".join(f"[{k}]" if isinstance(k, int) else str(k) for k in path).replace(".[", "[")


# ---------------------------------------------------------------------------------------------------------------
# Where a key came from


def _source(loader: Any, config_name: str, overrides: Sequence[str], run_mode: Any, path: Path, value: Any) -> str:
    """The last config file of the defaults list that sets `path` to `value`, else the command-line override."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        defaults = loader.compute_defaults_list(config_name, list(overrides), run_mode).defaults
    except Exception:  # noqa: BLE001 - naming the source is best effort; the refusal stands
        defaults = []
    for d in reversed(defaults):
        loaded = loader.repository.load_config(d.config_path) if d.config_path else None
        if loaded is None:
            continue
        here = _lookup(_container(ConfigLoaderImpl._embed_result_config(loaded, d.package).config), path)
        if here is not _MISSING and (value is _MISSING or here == value):
            return _file_name(loaded, d, config_name)
    for ov in OverridesParser.create().parse_overrides(list(overrides)):
        if _related(tuple(ov.key_or_group.split(".")), tuple(str(k) for k in path)):
            return f"command-line override '{ov.input_line}'"
    return "the composition"


def _file_name(loaded: Any, default: Any, config_name: str) -> str:
    """The file behind a loaded config: conf/ (`file://DIR`), a recipe folder or a recipe file named by path
    (config/sources.py: `scheme://FILE`); Hydra's own packaged configs by their name."""
    where = str(loaded.path)
    rest = where.split("://", 1)[1] if "://" in where else where
    candidate = rest if os.path.isfile(rest) else os.path.join(rest, f"{default.config_path}.yaml")
    name = os.path.realpath(candidate) if os.path.isfile(candidate) else f"{default.config_path} in {where}"
    if default.parent not in (None, "<root>", config_name, default.config_path):
        name += f", pulled in by the defaults list of {default.parent}"
    return name


# ---------------------------------------------------------------------------------------------------------------
# Sweeps


class GuardedLoader:
    """Hydra's config loader with every composition it returns checked (the sweep's and each job's), so a sweep
    never instantiates or runs an unchecked composition; everything else is Hydra's own loader."""

    def __init__(self, inner: Any, config_name: str):
        self._inner, self._config_name = inner, config_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_configuration(self, config_name: str, overrides: List[str], run_mode: Any, **kwargs: Any) -> Any:
        cfg = self._inner.load_configuration(config_name=config_name, overrides=overrides, run_mode=run_mode, **kwargs)
        check(self._inner, config_name, overrides, cfg, run_mode)
        return cfg

    def load_sweep_config(self, master_config: Any, sweep_overrides: List[str]) -> Any:
        from hydra.types import RunMode

        cfg = self._inner.load_sweep_config(master_config, sweep_overrides)
        overrides = list(master_config.hydra.overrides.hydra) + list(sweep_overrides)
        check(self._inner, self._config_name, overrides, cfg, RunMode.RUN)
        return cfg


def check_sweep(loader: Any, config_name: str, overrides: Sequence[str]) -> None:
    """Compose and check the sweep and every job of it (as Hydra's basic sweeper will split it) before anything of
    the sweep exists; `loader` is a GuardedLoader. Other composition errors are left to Hydra and the jobs."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    try:
        master = loader.load_configuration(config_name=config_name, overrides=list(overrides),
                                           run_mode=RunMode.MULTIRUN)
        task = list(master.hydra.overrides.task)
        batches = BasicSweeper.split_arguments(OverridesParser.create(config_loader=loader).parse_overrides(task), None)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - Hydra reports its own composition errors when the sweep starts
        return
    for job in (job for batch in batches for job in batch):
        try:
            loader.load_sweep_config(master, list(job))
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - a job that cannot be composed fails on its own, as before
            continue
