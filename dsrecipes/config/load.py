"""The one road from a Hydra composition to a typed, validated `TrainConfig`.

Hydra merges the YAML files into a structured (TrainConfig-typed) node, which already rejects unknown keys and
wrong types inside YAML files and `key=value` overrides. We then convert the resolved container ourselves, field by
field, so that keys Hydra lets through (`+key=value` adds keys that `OmegaConf.to_object` would silently drop) and
every type or enum problem is reported with its dotted path, all at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from dsrecipes.config.hints import clean_hydra_message, full_key, schema_keys
from dsrecipes.errors import ConfigError
from dsrecipes.schema import TrainConfig
from dsrecipes.suggest import closest, phrase


def compose(overrides: Sequence[str] = ()) -> Any:
    """conf/train.yaml with overrides, checked for code (config/hydra_app.py)."""
    import dsrecipes.config.hydra_app as hydra_app  # Hydra's runner: 0.4 s to import, which ranks (load_run_config) skip

    return hydra_app.compose(overrides)


@contextlib.contextmanager
def hydra_context() -> Iterator[None]:
    """Hydra initialised once; compose() calls inside reuse it (validate --all composes hundreds)."""
    import dsrecipes.config.hydra_app as hydra_app  # see compose()

    with hydra_app.hydra_context():
        yield


# ---------------------------------------------------------------------------------------------------------------
# Container -> dataclass, collecting every problem with its dotted path.


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(m.value for m in tp)
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str, errors: List[str]) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert(args[0], value, path, errors)
    if value is None:
        errors.append(f"{path}: must not be null (expected {_type_name(tp)})")
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
            return None
        return _to_dataclass(tp, value, path, errors)
    if origin in (list, List):
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path}: expected a list, got {value!r}")
            return None
        return [_convert(item_tp, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return {str(k): _convert(val_tp, v, f"{path}.{k}", errors) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value.value if isinstance(value, Enum) else value)
        except ValueError:
            hint = phrase(closest(str(value), [m.value for m in tp]))
            errors.append(f"{path}: invalid value {value!r}; expected {_type_name(tp)}{hint}")
            return None
    if tp is bool:
        if isinstance(value, bool):
            return value
        errors.append(f"{path}: expected true or false, got {value!r}")
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        errors.append(f"{path}: expected an integer, got {value!r}")
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        errors.append(f"{path}: expected a number, got {value!r}")
        return None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        errors.append(f"{path}: expected a string, got {value!r}")
        return None
    if tp is Any:
        return value
    raise TypeError(f"schema type {tp!r} at {path} is not supported")


def _to_dataclass(cls: Any, data: Dict[str, Any], path: str, errors: List[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            near = [f"{path}.{n}" if path else n for n in closest(str(key), names)]
            near = near if path or near else full_key(str(key), schema_keys())  # `+learning_rate=` -> optimizer.lr
            hint = phrase(near) or f" (valid keys of {cls.__name__}: {', '.join(sorted(names))})"
            errors.append(f"{where}: unknown key{hint}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            where = f"{path}.{f.name}" if path else f.name
            kwargs[f.name] = _convert(hints[f.name], data[f.name], where, errors)
    if any(v is None for k, v in kwargs.items() if not _optional(hints[k])):
        return None  # an error was recorded below this node
    return cls(**kwargs)


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)


def from_dict(data: Dict[str, Any]) -> Tuple[Optional[TrainConfig], List[str]]:
    errors: List[str] = []
    cfg = _to_dataclass(TrainConfig, data, "", errors)
    return cfg, errors


def config_to_dict(cfg: Any) -> Any:
    """TrainConfig (or any nested value) -> plain YAML/JSON-able data (enums as their values)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Enum):
        return cfg.value
    if isinstance(cfg, (list, tuple)):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: config_to_dict(v) for k, v in cfg.items()}
    return cfg


# ---------------------------------------------------------------------------------------------------------------


def check_composition(
    composed: Any, *, check_files: bool = True, overrides: Sequence[str] = ()
) -> Tuple[Optional[TrainConfig], List[str], List[str]]:
    """(config, schema problems, rule problems). Rules are only checked once the schema is clean."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    from dsrecipes.config.validate import validate

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
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path}: no resolved config here; start runs with `python -m dsrecipes`")
    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    return load_config(data, check_files=True)
