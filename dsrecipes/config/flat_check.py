"""Every problem of a recipe file's plain keys at once, before Hydra composes it (Hydra stops at the first unknown
key, so a LLaMA-Factory file took one run per key).

Each top-level key of a flat (or `_global_`) recipe file, and each key nested under it, is one of:
  - a config group with an option (`zero: stage2`): the option must exist;
  - a schema key (`optimizer.lr`, `trainer: {max_steps: 5}`): its value must have the key's type (values with a
    `${...}` interpolation are left to the composition, which resolves them);
  - anything else: a problem, with another tool's spelling translated (config/foreign_keys.py: `learning_rate` ->
    optimizer.lr, `stage: dpo` -> objective: dpo, `do_train` -> not needed here) or the closest schema keys.
`defaults`, `hydra` and `recipe` are left to Hydra. Problems read `FILE:LINE: key: what`, all of them in one
ConfigError (exit 2); cross-field rules are checked after composition (config/validate.py), all at once too.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from dsrecipes.config.foreign_keys import foreign_key, foreign_option
from dsrecipes.config.groups import RECIPE_GROUP, group_options
from dsrecipes.config.lf_translate import in_our_keys as translate
from dsrecipes.config.lf_translate import read_together
from dsrecipes.core.schema import RETIRED_KEYS, TrainConfig
from dsrecipes.core.suggest import closest, closest_keys, phrase
from dsrecipes.core.typed import convert

LEFT_TO_HYDRA = ("defaults", "hydra", RECIPE_GROUP)


def schema_types(cls: Any = TrainConfig, prefix: str = "") -> Dict[str, Any]:
    """{dotted key: its type} for every key of the schema, inner nodes included (a section's Optional unwrapped; a
    leaf keeps it, so `trainer.max_steps: null` is accepted where the schema allows null)."""
    out: Dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = tp
        if typing.get_origin(tp) is typing.Union:
            inner = next(a for a in typing.get_args(tp) if a is not type(None))
        out[prefix + f.name] = inner if dataclasses.is_dataclass(inner) else tp  # a leaf keeps Optional: null is a value
        if dataclasses.is_dataclass(inner):
            out.update(schema_types(inner, f"{prefix}{f.name}."))
    return out


def flat_problems(data: Dict[str, Any], where: str, line: Callable[[str], Optional[int]]) -> List[str]:
    """Every problem of the file's keys (module docstring); `where` names the file, `line(key)` finds a key's line."""
    types = schema_types()
    options = {g: o for g, o in group_options().items() if g != RECIPE_GROUP}
    out = []
    together = read_together(data)  # `neat_packing: true` beside `packing: false`, ...: what LF reads together
    registry = "dataset_dir" in data  # LLaMA-Factory's file: its `dataset` names entries, never a typo of ours
    for key, value in data.items():
        if str(key) in LEFT_TO_HYDRA or str(key).startswith("hydra."):
            continue
        for dotted, problem in _problems(str(key), value, types, options, registry):
            problem += f"; {together[dotted][1]}" if dotted in together else ""
            at = line(dotted)
            out.append(f"{where}:{at}: {problem}" if at else f"{where}: {problem}")
    return out


def in_our_keys(data: Dict[str, Any]) -> Optional[str]:
    """The file in our keys (config/lf_translate.in_our_keys), when a key of another tool in it was translated; else None."""
    types = schema_types()
    options = {g: o for g, o in group_options().items() if g != RECIPE_GROUP}
    problems = {dotted: problem for key, value in data.items() if str(key) not in LEFT_TO_HYDRA
                for dotted, problem in _problems(str(key), value, types, options) if dotted == str(key)}
    return translate(data, problems)


def _problems(key: str, value: Any, types: Dict[str, Any], options: Dict[str, List[str]], registry: bool = False
              ) -> Iterator[Tuple[str, str]]:
    if key in options and (isinstance(value, (str, int)) and not isinstance(value, bool) or value is None):
        if value is not None and str(value) not in options[key]:  # `zero: 3`: a number for an option's name
            yield key, _no_option(key, str(value), options[key], registry and key == "dataset")
        return
    tp = types.get(key)
    if tp is None:
        yield key, _unknown(key, value, types, options)
    elif dataclasses.is_dataclass(tp) and isinstance(value, dict):
        for inner, inner_value in value.items():
            yield from _problems(f"{key}.{inner}", inner_value, types, options)
    elif not _interpolated(value):
        errors: List[str] = []
        convert(tp, value, key, errors)
        yield from ((key, e) for e in errors)


def _no_option(group: str, value: str, names: List[str], entry: bool = False) -> str:
    """`entry`: the value names an entry of a dataset_info.json (the file has LLaMA-Factory's dataset_dir)."""
    close = [] if entry else closest(value, names)
    foreign = foreign_option(group, value, bool(close))  # `dataset: identity,alpaca_en_demo`, `template: qwen`
    if foreign:
        return f"{group}={value}: no option '{value}' in group '{group}'; {foreign}"
    return f"{group}={value}: no option '{value}' in group '{group}'{phrase(close)} (options: {', '.join(names)})"


def _unknown(key: str, value: Any, types: Dict[str, Any], options: Dict[str, List[str]]) -> str:
    if key in RETIRED_KEYS:
        return f"{key}: {RETIRED_KEYS[key]}"
    foreign = foreign_key(key, value) if "." not in key else None
    if foreign:
        return f"{key}: {foreign}"
    parent = key.rpartition(".")[0]
    leaf_foreign = foreign_key(key.rpartition(".")[2], value) if parent else None
    if leaf_foreign:  # `trainer.learning_rate`
        return f"{key}: unknown key; {leaf_foreign}"
    near = closest_keys(key, list(types) + ([] if parent else list(options)))
    if near:
        return f"{key}: unknown key{phrase(near)}"
    siblings = sorted(k.rpartition(".")[2] for k in types if k.rpartition(".")[0] == parent)
    return f"{key}: unknown key (keys of {parent or 'the config'}: {', '.join(siblings)})"


def _interpolated(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_interpolated(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_interpolated(v) for v in value)
    return False
