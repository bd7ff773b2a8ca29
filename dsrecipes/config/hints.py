"""Hydra's composition errors, rewritten as one dsrecipes message with the closest valid names (did you mean).

Hydra reports a mistyped key as "Could not override 'trainer.max_step'. To append to your config use +..." (advice
dsrecipes then rejects), a mistyped option as a list of every option, a YAML problem as a parser dump. Here the
exception chain (Hydra's and OmegaConf's exception attributes, not only their text) becomes: what is wrong, where
(`command-line override '...'` or the file), and the closest schema keys, groups, options or enum values.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence

from dsrecipes.suggest import closest, closest_keys, phrase


def explain(exc: BaseException, overrides: Sequence[str], fallback: str) -> str:
    """One message for a failed composition; `fallback` (Hydra's flattened text) when no rule applies."""
    chain = list(_chain(exc))
    context = _context(chain)
    for rule in (_bad_override, _yaml_error, _missing_option, _unknown_group, _unknown_key, _bad_value):
        text = rule(chain, list(overrides))
        if text:
            return f"{context}: {text}" if context and not text.startswith(context) else text
    return fallback


def schema_keys(cls: Any = None, prefix: str = "") -> List[str]:
    """Every dotted key of the schema, inner nodes included (`model`, `model.lora`, `model.lora.r`, ...)."""
    from dsrecipes.config.schema import TrainConfig

    cls = TrainConfig if cls is None else cls
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        inner = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            keys += schema_keys(inner, key + ".")
    return keys


def unwrap_optional(tp: Any) -> Any:
    """Optional[X] -> X (a List[X] stays a list: its items are not dotted keys)."""
    if typing.get_origin(tp) is typing.Union:
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def group_names() -> List[str]:
    from dsrecipes.config.groups import group_options

    return list(group_options())


# ---------------------------------------------------------------------------------------------------------------


def _chain(exc: Optional[BaseException]) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _context(chain: List[BaseException]) -> str:
    """The file a problem is in (`In 'recipe/x': ...` in Hydra's text), as a path people can open."""
    for exc in chain:
        found = re.match(r"In '([^']+)':", str(exc))
        if found and found.group(1) != "train":
            return config_file(found.group(1))
    return ""


def config_file(config_path: str) -> str:
    """Hydra's config path (`zero/stage2`, `recipe/NAME`, `recipe//abs/file.yaml`) -> the file it was read from."""
    from dsrecipes.config.sources import RECIPE_GROUP, is_path, user_recipes
    from dsrecipes.paths import conf_dir

    group, _, name = config_path.partition("/")
    if group == RECIPE_GROUP and is_path(name):
        return str(Path(name).expanduser())
    if group == RECIPE_GROUP and name in user_recipes():
        return str(user_recipes()[name])
    return str(conf_dir() / f"{config_path}.yaml")


def _blame(key: str, overrides: List[str]) -> str:
    for ov in overrides:
        if ov.split("=", 1)[0].lstrip("+~") == key:
            return f" [from command-line override '{ov}']"
    return ""


def _bad_override(chain: List[BaseException], overrides: List[str]) -> str:
    from hydra.errors import OverrideParseException

    exc = next((e for e in chain if isinstance(e, OverrideParseException)), None)
    if exc is None:
        return ""
    word = exc.override
    if "=" not in word:
        names = group_names() + schema_keys()
        near = [f"{n}=..." for n in ([word] if word in names else closest(word, names))]
        return f"'{word}' is not a command, KEY=VALUE, GROUP=OPTION or a flag{phrase(near)} (see dsrecipes --help)"
    return f"cannot parse override '{word}': {exc.message.split(chr(10))[0]} (quote values holding special characters: key='value')"


def _yaml_error(chain: List[BaseException], overrides: List[str]) -> str:
    import yaml

    for exc in chain:
        if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
            mark = exc.problem_mark
            return f"{mark.name}:{mark.line + 1}: not valid YAML: {exc.problem}" + (
                f" ({exc.context})" if exc.context else "")
    return ""


def _missing_option(chain: List[BaseException], overrides: List[str]) -> str:
    from hydra.errors import MissingConfigException

    from dsrecipes.config.sources import RECIPE_GROUP, is_path

    exc = next((e for e in chain if isinstance(e, MissingConfigException)), None)
    if exc is None or not exc.missing_cfg_file or "/" not in exc.missing_cfg_file:
        return ""
    group, _, option = exc.missing_cfg_file.partition("/")
    typed = f"{group}={option}"
    if group == RECIPE_GROUP and is_path(option):
        return f"{typed}: no such file: {Path(option).expanduser().resolve()}{_blame(group, overrides)}"
    options = list(exc.options or [])
    where = _blame(group, overrides) or " [in a defaults list: a recipe's or a group file's]"
    return (f"{typed}: no option '{option}' in group '{group}'{phrase(closest(option, options))} "
            f"(options: {', '.join(options)}){where}")


def _unknown_group(chain: List[BaseException], overrides: List[str]) -> str:
    for exc in chain:
        found = re.search(r"Could not override '([^']+)'\. No match in the defaults list", str(exc))
        if found:
            group = found.group(1).lstrip("/")
            return f"no config group '{group}'{phrase(closest(group, group_names()))} (groups: {', '.join(group_names())})"
    return ""


def _unknown_key(chain: List[BaseException], overrides: List[str]) -> str:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key_error = next((e for e in chain if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and e.full_key), None)
    if key_error is None:
        return ""
    typed = str(key_error.full_key)
    for exc in chain:
        found = re.match(r"Could not override '([^']+)'", str(exc))
        if found:
            typed = found.group(1)
    if typed.startswith("hydra."):
        return ""
    blame = _blame(typed, overrides)
    from dsrecipes.config.schema import RETIRED_KEYS

    if typed in RETIRED_KEYS:
        return f"{typed}: {RETIRED_KEYS[typed]}{blame}"
    if "is not in struct" in str(key_error.msg) and key_error.object_type is dict:
        parent = typed.rpartition(".")[0]
        return f"{parent} is a mapping: add a key to it with +{typed}=VALUE{blame}"
    keys = schema_keys()
    hint = phrase(closest_keys(typed, keys + ([] if "." in typed else group_names())))
    if not hint:  # nothing close: name what the parent holds
        parent = typed.rpartition(".")[0]
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
        hint = f" (keys of {parent or 'the config'}: {', '.join(siblings)})" if siblings else ""
    return f"{typed}: unknown key{hint}{blame}"


def _bad_value(chain: List[BaseException], overrides: List[str]) -> str:
    from omegaconf.errors import ValidationError

    exc = next((e for e in chain if isinstance(e, ValidationError) and e.full_key and e.msg), None)
    if exc is None or str(exc.full_key).startswith("hydra."):
        return ""
    key, msg = str(exc.full_key), str(exc.msg).split("\n")[0]
    if "is not a ListConfig" in msg:
        given = next((ov.split("=", 1)[1] for ov in overrides if ov.split("=", 1)[0].lstrip("+~") == key), "VALUE")
        return f"{key} is a list: write {key}=[{given}] (several values: [a,b]){_blame(key, overrides)}"
    found = re.match(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", msg)
    if found:
        value, options = found.group(1), [o.strip() for o in found.group(2).split(",")]
        msg = f"invalid value '{value}' (expected one of {', '.join(options)}){phrase(closest(value, options))}"
    return f"{key}: {msg}{_blame(key, overrides)}"
