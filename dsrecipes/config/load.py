"""The one road from a Hydra composition to a typed, validated `TrainConfig`.

Hydra merges the YAML files into a structured (TrainConfig-typed) node, which already rejects unknown keys and
wrong types inside YAML files and `key=value` overrides. We then convert the resolved container ourselves, field by
field, so that keys Hydra lets through (`+key=value` adds keys that `OmegaConf.to_object` would silently drop) and
every type or enum problem is reported with its dotted path, all at once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import yaml

import dsrecipes.core.bounded_yaml as bounded_yaml
from dsrecipes.config.hints import clean_hydra_message, full_key, schema_keys
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.fileio import read_regular_bytes
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.typed import to_dataclass


def compose(overrides: Sequence[str] = ()) -> Any:
    """conf/train.yaml with overrides, checked for code (config/hydra_app.py)."""
    import dsrecipes.config.hydra_app as hydra_app  # lazy: Hydra's runner, 0.13 s; ranks (worker) skip it

    return hydra_app.compose(overrides)


@contextlib.contextmanager
def hydra_context() -> Iterator[None]:
    """Hydra initialised once; compose() calls inside reuse it (validate --all composes hundreds)."""
    import dsrecipes.config.hydra_app as hydra_app  # lazy: see compose()

    with hydra_app.hydra_context():
        yield


def from_dict(data: Dict[str, Any]) -> Tuple[Optional[TrainConfig], List[str]]:
    errors: List[str] = []
    cfg = to_dataclass(TrainConfig, data, "", errors, top_hint=lambda key: full_key(key, schema_keys()))
    return cfg, errors


# ---------------------------------------------------------------------------------------------------------------


def check_composition(
    composed: Any, *, check_files: bool = True, overrides: Sequence[str] = ()
) -> Tuple[Optional[TrainConfig], List[str], List[str]]:
    """(config, schema problems, rule problems). Rules are only checked once the schema is clean."""
    from omegaconf import DictConfig, ListConfig, OmegaConf  # lazy: else `worker` imports omegaconf 0.06 s

    from dsrecipes.config.validate import validate  # lazy: else `commands.show` imports numpy 0.11 s

    if isinstance(composed, DictConfig):
        try:  # key by key: Hydra's own `hydra` node (present in a job's composition) is not ours to resolve
            data = {k: OmegaConf.to_container(composed[k], resolve=True, enum_to_str=True) if
                    isinstance(composed[k], (DictConfig, ListConfig)) else composed[k]
                    for k in composed.keys() if k != "hydra"}
        except Exception as exc:
            return None, [clean_hydra_message(exc)], []
    else:
        data = composed
    cfg, schema_errors = from_dict(data)
    schema_errors = [_blame_override(e, overrides) for e in schema_errors]
    if cfg is None or schema_errors:
        return None, schema_errors, []
    return cfg, [], validate(cfg, check_files=check_files)


def load_config(composed: Any, *, check_files: bool = True, overrides: Sequence[str] = ()) -> TrainConfig:
    """Composition (DictConfig or plain dict) -> validated TrainConfig, or ConfigError listing every problem."""
    cfg, schema_errors, rule_errors = check_composition(composed, check_files=check_files, overrides=overrides)
    if schema_errors or rule_errors:
        raise ConfigError(schema_errors + rule_errors)
    return cfg


def _blame_override(error: str, overrides: Sequence[str]) -> str:
    key = error.split(":", 1)[0]
    for ov in overrides:
        name = ov.split("=", 1)[0].lstrip("+~")
        if name == key:
            return f"{error} [from command-line override '{ov}']"
    return error


def compose_and_load(overrides: Sequence[str] = (), *, check_files: bool = True) -> TrainConfig:
    return load_config(compose(overrides), check_files=check_files, overrides=overrides)


def load_run_config(run_dir: str | Path) -> TrainConfig:
    """What each rank does: read <run dir>/config.yaml (written by the launcher), never re-compose."""

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path}: no resolved config here; start runs with `python -m dsrecipes`")
    return load_config(read_yaml_mapping(path), check_files=True)


def read_yaml_mapping(path: Path) -> Dict[str, Any]:
    """A YAML file that must hold a mapping (a run's config.yaml), or ConfigError naming `file:line`."""
    try:  # never a FIFO's endless wait; a shared run's alias bomb is refused before it is walked
        data = bounded_yaml.safe_load(read_regular_bytes(path).decode("utf-8"))
    except bounded_yaml.TooLarge as exc:
        raise ConfigError(f"{path}: {exc}; a run's config.yaml written by dsrecipes holds no aliases") from None
    except bounded_yaml.SelfReference as exc:
        raise ConfigError(f"{path}:{exc}: an alias (*name) inside its own value") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except ValueError as exc:  # not a regular file; a number of more digits than Python converts (4300)
        raise ConfigError(f"{path}: not a run's config.yaml ({str(exc)[:120]})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc}); this file is written "
                          "by the launching process: restore it, or start a new run directory") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: holds a {type(data).__name__}, not a run's resolved config (a mapping of keys)")
    return data
