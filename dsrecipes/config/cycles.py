"""A recipe that includes a recipe (itself, directly or through others, or any other) as one message.

Hydra follows a defaults list into itself until Python's recursion limit ("maximum recursion depth exceeded"); when
a composition fails that way, `recipe_cycle(overrides)` follows the recipes' defaults lists itself, each file read
once through config/recipe_file.py (bounded), and names the files of the first cycle it finds. A recipe that names
another recipe without a cycle fails the same way (`/recipe: X`: Hydra recurses too) or is silently ignored
(`override /recipe: X` in the recipe the command line chose): `included_recipe(overrides)` names that entry by
`file:line` (config/hydra_app.py checks every composition with it), as `climbing_entries` names an entry that
leaves the config tree ('..').
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

from omegaconf import OmegaConf

import dsrecipes.config.recipe_file as recipe_file
import dsrecipes.config.sources as sources
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.paths import shipped_recipes_dir


def recipe_cycle(overrides: Sequence[str]) -> str:
    """The message for a composition that recursed without end."""
    for ov in overrides:
        key, eq, value = ov.partition("=")
        if eq and key.lstrip("+~").split("@")[0] == sources.RECIPE_GROUP:
            found = _walk(_find(value.strip()), [])
            if found:
                return ("recipe: the recipes include each other in a cycle: " + " -> ".join(map(str, found)) +
                        "; remove the entry that leads back from the defaults list")
    return included_recipe(overrides) or (
        "the defaults lists include each other in a cycle (a recipe or group file that names itself, directly "
        "or through others); remove the entry that leads back")


def included_recipe(overrides: Sequence[str]) -> Optional[str]:
    """`FILE:LINE: defaults: ...` for a recipe of the command line whose defaults list names a recipe, else None."""
    for path in chosen(overrides):
        try:
            config, _ = recipe_file.load(path)
        except ConfigError:
            continue  # the composition itself reports an unreadable recipe
        for name in _included(config):
            line = recipe_file.line_of(path, "defaults")
            return (f"{path}{f':{line}' if line else ''}: defaults: recipe {name!r}: a recipe cannot include another "
                    "recipe (a composition has one; Hydra would ignore or recurse into it): copy the keys you need "
                    "from it into this file, or give it as recipe= with your keys as overrides")
    return None


def climbing_entries(composed: Any, overrides: Sequence[str]) -> List[str]:
    """Defaults-list entries (Hydra's hydra.runtime.choices of `composed`: every group choice it resolved) whose group or
    option climbs out of the config tree with a '..' segment. Hydra's file and package sources join that name to
    their folder, so `override /debug: ../../../PATH/evil` (in a shared recipe, a group file or on the command line)
    loads a file from anywhere under the config tree's name, and config/safety.py would take its values as the
    tree's (the user's own): a shared recipe's tracking server or cache directory passed as the user's. The `recipe`
    choice is the command line's own (`recipe=../mine.yaml` names a file; a recipe naming one is refused above)."""
    try:
        choices: Dict[str, Any] = dict(OmegaConf.to_container(composed.hydra.runtime.choices))
    except Exception:  # noqa: BLE001 - a composition without Hydra's record: nothing to check
        return []
    problems = []
    for group, option in choices.items():
        name = f"{group}/{option}" if option is not None else str(group)
        if group == sources.RECIPE_GROUP or ".." not in name.split("/"):
            continue
        source = _entry_source(overrides, str(option))
        problems.append(f"{source + ': ' if source else ''}defaults: {group} {option!r}: a '..' segment names a "
                        "config file outside the config tree, which would be taken as the tree's own; a defaults "
                        "entry names an option of a group (conf/GROUP/NAME.yaml), and a recipe of yours is given as "
                        "recipe=FILE.yaml")
    return problems


def _entry_source(overrides: Sequence[str], option: str) -> str:
    """Who wrote a defaults entry naming `option`: a chosen recipe's `file:line`, or the command-line override ('':
    a group file's defaults list)."""
    for path in chosen(overrides):
        try:
            config, _ = recipe_file.load(path)
        except ConfigError:
            continue
        entries = (config.get("defaults") or []) if hasattr(config, "get") else []
        if any(hasattr(e, "values") and option in [str(v) for v in e.values()] for e in entries):
            line = recipe_file.line_of(path, "defaults")
            return f"{path}{f':{line}' if line else ''}"
    for ov in overrides:
        if ov.partition("=")[2] == option:
            return f"command-line override {ov!r}"
    return ""


def chosen(overrides: Sequence[str]) -> Iterator[Path]:
    """The recipe files that `recipe=` overrides name (each value of a sweep's `recipe=a.yaml,b.yaml`)."""
    for ov in overrides:
        key, eq, value = ov.partition("=")
        if eq and key.lstrip("+~").split("@")[0] == sources.RECIPE_GROUP:
            for name in dict.fromkeys([value.strip(), *(v.strip() for v in value.split(","))]):
                path = _find(name) if name else None
                if path is not None:
                    yield path


def _find(name: str) -> Optional[Path]:
    if sources.is_path(name):
        path = Path(os.path.expanduser(name))
        path = path if path.suffix in (".yaml", ".yml") else path.with_suffix(".yaml")
        return path.resolve()
    try:
        user = sources.user_recipes().get(name)
    except ConfigError:
        user = None
    path = user or shipped_recipes_dir() / f"{name}.yaml"
    return path.resolve() if path.is_file() else None


def _walk(path: Optional[Path], chain: List[Path]) -> Optional[List[Path]]:
    if path is None:
        return None
    if path in chain:
        return chain[chain.index(path):] + [path]
    try:
        config, _ = recipe_file.load(path)
    except ConfigError:
        return None
    for name in _included(config):
        found = _walk(_find(name), chain + [path])
        if found:
            return found
    return None


def _included(config: Any) -> List[str]:
    """The recipes a recipe's defaults list names (`/recipe: X`, `override /recipe: X`, or a bare `X`)."""
    names = []
    for entry in (config.get("defaults") or []) if hasattr(config, "get") else []:
        if isinstance(entry, str) and entry != "_self_":
            names.append(entry)
        elif hasattr(entry, "items"):
            for key, value in entry.items():
                group = str(key).replace("override ", "").strip().lstrip("/").split("@")[0]
                if group == sources.RECIPE_GROUP and isinstance(value, str):
                    names.append(value)
    return names
