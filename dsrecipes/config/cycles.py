"""A recipe that includes a recipe (itself, directly or through others, or any other) as one message.

Hydra follows a defaults list into itself until Python's recursion limit ("maximum recursion depth exceeded"); when
a composition fails that way, `recipe_cycle(overrides)` follows the recipes' defaults lists itself, each file read
once through config/recipe_file.py (bounded), and names the files of the first cycle it finds. A recipe that names
another recipe without a cycle fails the same way (`/recipe: X`: Hydra recurses too) or is silently ignored
(`override /recipe: X` in the recipe the command line chose): `included_recipe(overrides)` names that entry by
`file:line` (config/hydra_app.py checks every composition with it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence

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
    for path in _chosen(overrides):
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


def _chosen(overrides: Sequence[str]) -> Iterator[Path]:
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
