"""Plain data <-> the schema's types: the one typed conversion (a mapping -> a schema dataclass, every problem with
its dotted path, all at once) and its inverse (`config_to_dict`, enums as their values).

config/load.py converts a whole composition with it; the dataset registry (data/sources/registry.py) converts one
entry. It imports no config/ module, so data/ can use it without a tie to config/.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Any, Callable, Dict, List, Optional

from dsrecipes.core.suggest import closest, phrase


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(m.value for m in tp)
    return getattr(tp, "__name__", str(tp))


def convert(tp: Any, value: Any, path: str, errors: List[str]) -> Any:
    """`value` as schema type `tp` (dataclass, Enum, Optional, List, Dict, scalars); None and a message in `errors`
    (dotted path first) where it does not fit."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return convert(args[0], value, path, errors)
    if value is None:
        errors.append(f"{path}: must not be null (expected {_type_name(tp)})")
        return None
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
            return None
        return to_dataclass(tp, value, path, errors)
    if origin in (list, List):
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path}: expected a list, got {value!r}")
            return None
        return [convert(item_tp, v, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin in (dict, Dict):
        _, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return {str(k): convert(val_tp, v, f"{path}.{k}", errors) for k, v in value.items()}
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


def to_dataclass(cls: Any, data: Dict[str, Any], path: str, errors: List[str],
                 top_hint: Optional[Callable[[str], List[str]]] = None) -> Any:
    """A mapping -> `cls`, every problem appended to `errors` with its dotted path; `top_hint(key)` names what an
    unknown top-level key most likely means (config/load.py passes the schema-wide key finder)."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            near = [f"{path}.{n}" if path else n for n in closest(str(key), names)]
            near = near if path or near or top_hint is None else top_hint(str(key))  # `+learning_rate=` -> optimizer.lr
            hint = phrase(near) or f" (valid keys of {cls.__name__}: {', '.join(sorted(names))})"
            errors.append(f"{where}: unknown key{hint}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            where = f"{path}.{f.name}" if path else f.name
            kwargs[f.name] = convert(hints[f.name], data[f.name], where, errors)
    if any(v is None for k, v in kwargs.items() if not optional(hints[k])):
        return None  # an error was recorded below this node
    return cls(**kwargs)


def optional(tp: Any) -> bool:
    return typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)


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
