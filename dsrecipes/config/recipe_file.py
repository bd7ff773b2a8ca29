"""A user's recipe file read with bounded work, and its flat form.

Bounded: a recipe file is read only if it is a readable regular file of at most MAX_BYTES, and parsed only if its
YAML, aliases expanded, holds at most MAX_VALUES values (an alias bomb - a few lines whose aliases expand to
billions of values - is refused in milliseconds: the size is counted on the node graph, each shared node once).
Anything else is one ConfigError naming the file (and the line, for YAML mistakes): a symlink loop, a directory,
a device, bytes that are not UTF-8, an unreadable file.

Flat: a file without a `# @package` header is a recipe of plain keys, as people write them for LLaMA-Factory or
axolotl:

    zero: stage2              # a string for a config group: that group's option (override /zero: stage2)
    model: smollm2_135m
    optimizer:
      lr: 3.0e-4              # everything else: values at their place in the config (package _global_)
    trainer.max_steps: 200    # dotted keys are nested keys

A file with `# @package _global_` (the shipped recipes' form: a defaults list of `override /GROUP: OPTION`) is used
as it is. Both forms have their keys checked first, all at once (config/flat_check.py): every unknown key (another
tool's spelled ours: `learning_rate` -> optimizer.lr, `stage: dpo` -> objective: dpo), missing option and wrong type
of the file is one message, not one run each.
"""

from __future__ import annotations

import io
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml
from hydra.plugins.config_source import ConfigSource
from omegaconf import OmegaConf

from dsrecipes.config.flat_check import flat_problems, in_our_keys
from dsrecipes.config.groups import RECIPE_GROUP, group_options
from dsrecipes.core.bounded_yaml import MAX_VALUES
from dsrecipes.core.bounded_yaml import SelfReference as _SelfReference
from dsrecipes.core.bounded_yaml import expanded_size as _values
from dsrecipes.core.errors import ConfigError

MAX_BYTES = 1 << 20  # 1 MiB: recipes are a screen of keys


def read(path: Path) -> str:
    """The text of a recipe file, or ConfigError naming it."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{path}: {_why(exc)}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise ConfigError(f"{path}: {kind}; a recipe is a YAML file")
    if info.st_size > MAX_BYTES:
        raise ConfigError(f"{path}: {info.st_size} bytes; a recipe file holds at most {MAX_BYTES} bytes")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: {_why(exc)}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: more than {MAX_BYTES} bytes; a recipe file holds at most {MAX_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {exc.start}); a recipe is a YAML file") from None


def _why(exc: OSError) -> str:
    if exc.errno == 40:  # ELOOP
        return "a symlink loop (the link points back at itself); point it at a file"
    return f"cannot read ({exc.strerror or exc})"


def parse(path: Path, text: str) -> Any:
    """The file's YAML as an OmegaConf node (the loader every conf/ file goes through), within the budget."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        size = _values(node, {}) if node is not None else 0
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(f"{_where(path, exc)}: not valid YAML: {exc.problem or exc.context}{_braces(text, exc)}") \
            from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a recipe") from None
    except _SelfReference as exc:
        raise ConfigError(f"{path}:{exc}: an alias (*name) inside the value it names: the value would be infinite") from None
    if size > MAX_VALUES:
        raise ConfigError(f"{path}: its YAML aliases (*name) expand to more than {MAX_VALUES} values; a recipe "
                          "holds a screen of keys: write the values out (or use fewer aliases)")
    if node is None:
        return OmegaConf.create({})
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: a recipe is a mapping of keys (key: value), "
                          f"not a {'list' if isinstance(node, yaml.SequenceNode) else 'single value'}")
    try:  # the constructor runs here: an unknown tag (`!!python/object/apply:...`) is refused by its SafeLoader
        return OmegaConf.load(io.StringIO(text))
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(f"{_where(path, exc)}: not valid YAML: {exc.problem or exc.context}") from None
    except ValueError:
        found = long_number(text)
        if found is None:
            raise
        raise ConfigError(f"{path}:{text[:found[0]].count(chr(10)) + 1}: {TOO_LONG.format(found[1])}") from None


TOO_LONG = "a whole number of {} digits does not fit in 64 bits (numpy and torch count in them)"


def long_number(text: str) -> Optional[Tuple[int, int]]:
    """(offset, digits) of the first whole number in `text` longer than Python converts (sys.get_int_max_str_digits():
    YAML's and Hydra's override parser's int() raise a bare ValueError naming neither key nor line), else None."""
    limit = sys.get_int_max_str_digits()
    for found in re.finditer(r"\d[\d_]*", text) if limit else ():
        digits = len(found.group().replace("_", ""))
        if digits > limit:
            return found.start(), digits
    return None


def _where(path: Path, exc: "yaml.MarkedYAMLError") -> str:
    mark = exc.problem_mark or exc.context_mark
    return f"{path}:{mark.line + 1}" if mark is not None else str(path)


def _braces(text: str, exc: "yaml.MarkedYAMLError") -> str:
    """`[${dsr.asset:sample_data}/pairs.jsonl]`: YAML reads the `{` of an interpolation as a mapping inside the list."""
    mark = exc.problem_mark or exc.context_mark
    line = text.splitlines()[mark.line] if mark is not None and mark.line < len(text.splitlines()) else ""
    if "${" not in line:
        return ""
    return ("; inside [ ] or { } a ${...} value needs quotes ('${dsr.asset:sample_data}/x.jsonl'), or write the list "
            "as a block list, one '- item' a line")


def load(path: Path) -> Tuple[Any, Dict[str, Optional[str]]]:
    """(config, header) of a recipe file for Hydra: the flat form becomes the header form (see the opening comment);
    a `_global_` file gets the same group choices and dotted keys."""
    text = read(path)
    try:
        header = ConfigSource._get_header_dict(text[:512])  # Hydra's own reading of `# @package`
    except ValueError as exc:
        raise ConfigError(f"{path}:1: {exc}") from None
    config = parse(path, text)
    if header.get("package") in (None, "_global_"):
        data = OmegaConf.to_container(config, resolve=False)
        problems = flat_problems(data, str(path), lambda key: line_of(path, key))
        if problems:  # every unknown key, missing option and wrong type of the file in one message
            ours = in_our_keys(data)  # another tool's file: the whole of it in our keys, to paste
            raise ConfigError(problems, footer=f"{path} in our keys (`#` lines: see their problem above):\n{ours}"
                              if ours else "")
        config, header = flat_to_global(config), {**header, "package": "_global_"}
    return config, header


def flat_to_global(config: Any) -> Any:
    """Group choices (`zero: stage2`) -> a defaults list of overrides; dotted keys -> nested; the rest as it is."""
    groups = set(group_options()) - {RECIPE_GROUP}
    data = OmegaConf.to_container(config, resolve=False)
    defaults = list(data.pop("defaults", None) or [])
    out: Dict[str, Any] = {}
    for key, value in data.items():
        if key in groups and (isinstance(value, str) or value is None):
            defaults.insert(len(defaults) - (defaults[-1:] == ["_self_"]), {f"override /{key}": value})
            continue
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = _merged(node.get(parts[-1]), value)
    if defaults:
        out["defaults"] = defaults if "_self_" in defaults else defaults + ["_self_"]
    return OmegaConf.create(out)


def _merged(old: Any, new: Any) -> Any:
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}
    return new


def line_of(path: Path, key: str, group: str = "") -> Optional[int]:
    """The line (1-based) where a YAML file sets the dotted `key` (nested or dotted spelling; in a group's option
    file, `key` without its `group.` prefix), or None when it cannot tell."""
    try:
        root = yaml.compose(read(Path(path)), Loader=yaml.SafeLoader)
    except (ConfigError, yaml.YAMLError, RecursionError):
        return None
    parts = key.split(".")
    found = _find(root, parts)
    if found is None and group and parts[0] == group:
        found = _find(root, parts[1:])
    return found


def _find(node: Any, parts: List[str]) -> Optional[int]:
    if not parts or not isinstance(node, yaml.MappingNode):
        return None
    for k, v in node.value:
        names = str(k.value).split(".")
        if names == parts[: len(names)]:
            found = k.start_mark.line + 1 if len(names) == len(parts) else _find(v, parts[len(names):])
            if found is not None:
                return found
    return None
