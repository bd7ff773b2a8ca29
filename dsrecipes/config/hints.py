"""Hydra's composition errors, rewritten as one dsrecipes message with the closest valid names (did you mean).

Hydra reports a mistyped key as "Could not override 'trainer.max_step'. To append to your config use +..." (advice
dsrecipes then rejects), a mistyped option as a list of every option, a YAML problem as a parser dump. Here the
exception chain (Hydra's and OmegaConf's exception attributes, not only their text) becomes: what is wrong, where
(`command-line override '...'` or the file), and the closest schema keys, groups, options or enum values.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import typing
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence

import yaml

from dsrecipes.config.foreign_keys import FROM_OTHER_TOOLS, foreign_key, foreign_option
from dsrecipes.config.foreign_keys import RULES as FOREIGN_RULES
from dsrecipes.config.groups import group_options
from dsrecipes.config.resolvers import refused_resolver
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.paths import conf_dir
from dsrecipes.core.schema import RETIRED_KEYS, TrainConfig
from dsrecipes.core.suggest import closest, closest_keys, phrase


def explain(exc: BaseException, overrides: Sequence[str], fallback: str) -> str:
    """One message for a failed composition; `fallback` (Hydra's flattened text) when no rule applies."""
    chain = list(_chain(exc))
    context = _context(chain)
    for rule in (_long_number, _no_such_name, _number_option, _bad_override, _yaml_error, _missing_option, _unknown_group,
                 _ambiguous, _unknown_key, _bad_value):
        text = rule(chain, list(overrides))
        if text and context and not text.startswith(context):
            return f"{_at_line(context, text.split(':', 1)[0])}: {text}"
        if text:
            return text
    return fallback


def _at_line(file: str, key: str) -> str:
    """`FILE:LINE` when the file sets `key` (user recipe files and conf/ option files alike), else `FILE`."""
    from dsrecipes.config.recipe_file import line_of  # lazy: else `cli` imports hydra 0.12 s, omegaconf 0.06 s

    group = Path(file).parent.name if Path(file).parent.parent == conf_dir() else ""
    line = line_of(Path(file), key, group) if re.fullmatch(r"[\w.]+", key) else None
    return f"{file}:{line}" if line else file


def compose_error(exc: BaseException, overrides: Sequence[str]) -> ConfigError:
    """A failed composition as one message, with the closest valid names; our own ConfigError (a recipe file that
    cannot be read, config/recipe_file.py) as it is."""
    ours = next((e for e in _chain(exc) if isinstance(e, ConfigError)), None)
    if ours is not None:
        return ours
    if any(isinstance(e, RecursionError) for e in _chain(exc)):
        from dsrecipes.config.cycles import recipe_cycle  # lazy: only for this failure

        return ConfigError(recipe_cycle(overrides))
    return ConfigError(explain(exc, overrides, fallback=clean_hydra_message(exc)))


def clean_hydra_message(exc: BaseException) -> str:
    """Hydra/OmegaConf messages, flattened to one readable line (with the file and full key when known). A refusal of
    our own raised inside a resolver (hydra_app.readable_env) is that message, with the key it was resolving."""
    key = next((str(e.full_key) for e in _chain(exc) if getattr(e, "full_key", None)), "")
    ours = next((e for e in _chain(exc) if isinstance(e, ConfigError)), None)
    if ours is None:  # a resolver outside the registry (config/resolvers.py)
        ours = next((refused_resolver(str(e).strip()) for e in _chain(exc) if refused_resolver(str(e).strip())), None)
    if ours is not None:
        return f"{key}: {ours}" if key else str(ours)
    if key and any("Recursive interpolation detected" in str(e) for e in _chain(exc)):  # x=${x}, or x=${y} y=${x}
        return f"{key}: its value refers to itself (an interpolation ${{...}} that leads back to {key})"
    parts = []
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None:
        text = str(e).strip()
        if text and text not in seen:
            seen.add(text)
            parts.append(text)
        e = e.__cause__ or e.__context__
    kept = []
    for part in parts:
        part = part.split("Config search path")[0].strip()
        if "$VALUE" in part or not part:
            continue
        kept.append(re.sub(r"\s*\n\s*", "; ", part).rstrip(" ;"))
    return " | ".join(kept[:2])


def schema_keys(cls: Any = None, prefix: str = "") -> List[str]:
    """Every dotted key of the schema, inner nodes included (`model`, `model.lora`, `model.lora.r`, ...)."""

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
    return list(group_options())


# ---------------------------------------------------------------------------------------------------------------


def _chain(exc: Optional[BaseException]) -> Iterator[BaseException]:
    """`exc`, its cause or context, theirs, ...: each once (a cycle of contexts ends the walk)."""
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
    from dsrecipes.config.sources import (  # lazy: else `cli` imports hydra 0.12 s, omegaconf 0.06 s
        RECIPE_GROUP,
        is_path,
        user_recipes,
    )

    group, _, name = config_path.partition("/")
    if group == RECIPE_GROUP and is_path(name):
        return os.path.abspath(os.path.expanduser(name))
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
        return f"'{word}' is not a command, KEY=VALUE, GROUP=OPTION or a flag{phrase(_recipe_named(word) or near)} " \
            "(see dsrecipes --help)"
    return f"cannot parse override '{word}': {exc.message.split(chr(10))[0]} (quote values holding special characters: key='value')"


def _long_number(chain: List[BaseException], overrides: List[str]) -> str:
    """An override holding a whole number longer than Python converts: Hydra's parser raised a bare ValueError."""
    from dsrecipes.config.recipe_file import TOO_LONG, long_number  # lazy: else `cli` imports hydra

    if not any(isinstance(e, ValueError) and "integer string conversion" in str(e) for e in chain):
        return ""
    for ov in overrides:
        key, _, value = ov.partition("=")
        found = long_number(value)
        if found:
            return f"{key.lstrip('+~')}: {TOO_LONG.format(found[1])} [from command-line override '{ov[:40]}...']"
    return ""


def _no_such_name(chain: List[BaseException], overrides: List[str]) -> str:
    """`=5` (no key: Hydra's 'Config group override must be a string or a list. Got int') and a key too long to be
    a config group's file name (Hydra's ENAMETOOLONG, naming a file inside Hydra's own package)."""
    long_name = any(getattr(e, "errno", None) == errno.ENAMETOOLONG for e in chain)
    for ov in overrides:
        key = ov.partition("=")[0].lstrip("+~")
        if "=" in ov and not key:
            return f"cannot parse override '{ov[:40]}': no key before '=' (write KEY=VALUE or GROUP=OPTION)"
        if long_name and len(key.encode()) > 255:
            return f"'{key[:40]}...' ({len(key)} characters): no such key or config group (see dsrecipes ls)"
    return ""


def _number_option(chain: List[BaseException], overrides: List[str]) -> str:
    """`zero=3`: a number where a group takes an option name (Hydra: 'Config group override must be a string or a
    list. Got int', naming neither the key nor the options)."""
    if not any("Config group override must be a string or a list" in str(e) for e in chain):
        return ""
    options = group_options()
    for ov in overrides:
        group, _, value = ov.partition("=")
        group = group.lstrip("+~")
        names = options.get(group, [])
        if names and value and value not in names:
            return (f"{group}={value}: no option '{value}' in group '{group}'{phrase(closest(value, names))} "
                    f"(options: {', '.join(names)}){_blame(group, overrides)}")
    return ""


def _recipe_named(word: str) -> List[str]:
    """`dsrecipes train my_exp` for the file my_exp.yaml here, or a shipped recipe's bare name."""
    files = [f"{word}{ext}" for ext in (".yaml", ".yml") if os.path.isfile(f"{word}{ext}")]
    if files:
        return [f"{files[0]} (dsrecipes train {files[0]})"]
    return [f"recipe={word}"] if word in group_options().get("recipe", []) else []


def _yaml_error(chain: List[BaseException], overrides: List[str]) -> str:
    for exc in chain:
        if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
            mark = exc.problem_mark
            return f"{mark.name}:{mark.line + 1}: not valid YAML: {exc.problem}" + (
                f" ({exc.context})" if exc.context else "")
    return ""


def _missing_option(chain: List[BaseException], overrides: List[str]) -> str:
    from hydra.errors import MissingConfigException

    from dsrecipes.config.sources import (  # lazy: else `cli` imports hydra 0.12 s, omegaconf 0.06 s
        RECIPE_GROUP,
        is_path,
    )

    exc = next((e for e in chain if isinstance(e, MissingConfigException)), None)
    if exc is None or not exc.missing_cfg_file or "/" not in exc.missing_cfg_file:
        return ""
    group, _, option = exc.missing_cfg_file.partition("/")
    typed = f"{group}={option}"
    if group == RECIPE_GROUP and is_path(option):
        return f"{typed}: {_no_recipe_file(option)}{_blame(group, overrides)}"
    options = list(exc.options or [])
    where = _blame(group, overrides) or _chosen_in(group, overrides)
    close = closest(option, options)
    foreign = foreign_option(group, option, bool(close))  # `template=qwen`, `dataset=my_registry_entry`
    if foreign:
        return f"{typed}: no option '{option}' in group '{group}'; {foreign}{where}"
    return f"{typed}: no option '{option}' in group '{group}'{phrase(close)} (options: {', '.join(options)}){where}"


def _no_recipe_file(option: str) -> str:
    """`recipe=/etc/passwd` looks for /etc/passwd.yaml (sources.py): say which file, and why the one named is not."""
    named = os.path.abspath(os.path.expanduser(option))
    if option.endswith((".yaml", ".yml")):
        return f"no such file: {named}"
    if os.path.lexists(named):
        return f"no such file: {named}.yaml ({named} is not read as a recipe: a recipe file's name ends in .yaml or .yml)"
    return f"no such file: {named}.yaml"


def _chosen_in(group: str, overrides: List[str]) -> str:
    """` [in FILE:LINE]`: the recipe file of the command line that chooses an option of `group` (flat `zero: x` or
    a defaults list's `override /zero: x`)."""
    from dsrecipes.config.sources import RECIPE_GROUP  # lazy: else `cli` imports hydra 0.12 s, omegaconf 0.06 s

    pattern = re.compile(rf"^\s*(-\s*)?(override\s+)?/?{re.escape(group)}\s*:")
    for ov in overrides:
        key, _, value = ov.partition("=")
        if key.lstrip("+~") != RECIPE_GROUP or not value:
            continue
        file = config_file(f"{RECIPE_GROUP}/{value}")
        try:
            lines = Path(file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        line = next((n for n, text in enumerate(lines, 1) if pattern.match(text)), None)
        if line:
            return f" [in {file}:{line}]"
    return " [in a defaults list: a recipe's or a group file's]"


def _unknown_group(chain: List[BaseException], overrides: List[str]) -> str:
    for exc in chain:
        found = re.search(r"Could not override '([^']+)'\. No match in the defaults list", str(exc))
        if found:
            group = found.group(1).lstrip("/")
            return f"no config group '{group}'{phrase(closest(group, group_names()))} (groups: {', '.join(group_names())})"
    return ""


def _unknown_key(chain: List[BaseException], overrides: List[str]) -> str:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError  # lazy: else `cli` imports omegaconf 0.06 s

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

    if typed in RETIRED_KEYS:
        return f"{typed}: {RETIRED_KEYS[typed]}{blame}"
    if "." in typed and "is not in struct" in str(key_error.msg) and key_error.object_type is dict:
        if str(key_error.full_key).startswith(typed + "."):  # `KEY={a:1}`: Hydra merges into KEY, which is empty
            example = f" ({SPLIT_EXAMPLE})" if typed == "dataset.split.shares" else ""
            return f"{typed} is a mapping: set its keys with ++{typed}=VALUE{example}{blame}"
        return f"{typed.rpartition('.')[0]} is a mapping: add a key to it with +{typed}=VALUE{blame}"
    return _unknown(typed, overrides, blame)


def _unknown(typed: str, overrides: List[str], blame: str) -> str:
    """An unknown key: another tool's (LLaMA-Factory's) key with our spelling, else the closest keys."""
    renamed = typed in FROM_OTHER_TOOLS or isinstance(FOREIGN_RULES.get(typed), str)  # "did you mean" below
    foreign = foreign_key(typed, _given(typed, overrides)) if "." not in typed and not renamed else None
    if foreign:  # `stage=dpo`, `do_train=true`: LLaMA-Factory's key, with our spelling or why it is not needed
        return f"{typed}: {foreign}{blame}"
    keys = schema_keys()
    hint = phrase(full_key(typed, keys))
    if not hint:  # nothing close: name what the parent holds
        parent = typed.rpartition(".")[0]
        siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
        hint = f" (keys of {parent or 'the config'}: {', '.join(siblings)})" if siblings else ""
    return f"{typed}: unknown key{hint}{blame}"


SPLIT_EXAMPLE = "e.g. '++dataset.split.shares={sft:2,reward:4,rl:4}', DeepSpeed-Chat's --data_split 2,4,4"


def _ambiguous(chain: List[BaseException], overrides: List[str]) -> str:
    """`KEY=a,b` (Hydra: "Ambiguous value"): an unknown KEY is said as one; a known one with how to write it."""
    found = next((m for m in (re.match(r"Ambiguous value for argument '([^'=]+)=", str(e)) for e in chain) if m), None)
    if found is None:
        return ""
    key, keys = found.group(1).lstrip("+~"), schema_keys()
    blame = _blame(key, overrides)
    if key not in keys and key not in group_names():
        return _unknown(key, overrides, blame)
    if key in ("dataset.split", "dataset.split.shares"):
        return f"dataset.split.shares: share names and weights, {SPLIT_EXAMPLE}{blame}"
    return (f"{key}: a comma separates list items or sweep values: {key}=[a,b] (a list), {key}='a,b' (text), "
            f"dsrecipes -m {key}=a,b (a sweep){blame}")


def full_key(typed: str, keys: Sequence[str]) -> List[str]:
    """The keys a mistyped or misplaced key most likely means: another tool's name for it (`learning_rate` ->
    optimizer.lr), the same field name under its parent (`max_steps` -> trainer.max_steps), or a near spelling."""
    leaf = typed.rpartition(".")[2]
    if leaf in FROM_OTHER_TOOLS and FROM_OTHER_TOOLS[leaf] != typed:
        return [FROM_OTHER_TOOLS[leaf]]
    return closest_keys(typed, list(keys) + ([] if "." in typed else group_names()))


def _given(key: str, overrides: List[str]) -> Any:
    """The value the command line gives `key` (as YAML reads it), None when it gives none."""
    for ov in overrides:
        name, _, value = ov.partition("=")
        if name.lstrip("+~") == key:
            try:
                return yaml.safe_load(value)
            except yaml.YAMLError:
                return value
    return None


def _bad_value(chain: List[BaseException], overrides: List[str]) -> str:
    from omegaconf.errors import ValidationError  # lazy: else `cli` imports omegaconf 0.06 s

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
