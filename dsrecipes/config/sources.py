"""Where compositions come from: the shipped conf/ tree, the user's recipe folders, and recipe files named by path.

    recipe=NAME        NAME.yaml in a folder of $DSRECIPES_RECIPES (a path list like PATH; the first folder holding
                       NAME wins, and user folders win over the shipped recipes), else the shipped recipes/NAME.yaml
    recipe=FILE.yaml   any file: a value ending in .yaml/.yml, or starting with /, ./, ../ or ~, is a path (relative
                       to the working directory)

Both reach Hydra as options of the `recipe` group through two small config sources (Hydra's public ConfigSource
interface, hydra-core 1.3.x; config/hydra_app.py puts them on the search path), so a user recipe is composed exactly like a shipped one: the same `# @package _global_` header,
defaults list, typed schema checks and no-code rules, and Hydra records the override as the user typed it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource

import dsrecipes.config.recipe_file as recipe_file
from dsrecipes.core.errors import ConfigError

RECIPES_ENV = "DSRECIPES_RECIPES"
RECIPE_GROUP = "recipe"
_FOLDER_SCHEME = "dsrecipes-recipes"
_FILE_SCHEME = "dsrecipes-recipe-file"


def is_path(value: str) -> bool:
    """A `recipe=` value that names a file rather than a recipe name."""
    return value.endswith((".yaml", ".yml")) or value.startswith(("/", "./", "../", "~"))


def user_recipe_dirs() -> List[Path]:
    """The folders of $DSRECIPES_RECIPES, in order; a folder that does not exist is a ConfigError."""
    dirs = [Path(p).expanduser().resolve() for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep) if p.strip()]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise ConfigError(f"{RECIPES_ENV}: not a folder: {', '.join(missing)}")
    return dirs


def user_recipes() -> Dict[str, Path]:
    """{name: file} for every recipe in the user's folders (the first folder holding a name wins)."""
    found: Dict[str, Path] = {}
    for folder in user_recipe_dirs():
        for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
            found.setdefault(path.stem, path)
    return found


def folder_source_path(folder: Path) -> str:
    """The search-path entry that serves `recipe=NAME` from a user's folder (config/hydra_app.py adds it)."""
    return f"{_FOLDER_SCHEME}://{folder}"


def file_source_path(cwd: Path) -> str:
    """The search-path entry that serves `recipe=PATH.yaml`, relative paths against `cwd`."""
    return f"{_FILE_SCHEME}://{cwd}"


class _RecipeSourceBase(ConfigSource):
    """A config source that serves only `recipe/<value>` (nothing else of the tree)."""

    def _file(self, config_path: str) -> Optional[Path]:
        raise NotImplementedError

    def load_config(self, config_path: str) -> ConfigResult:
        path = self._file(config_path)
        if path is None or not os.path.lexists(path):
            raise ConfigLoadError(f"Config not found: {config_path}")
        config, header = recipe_file.load(path)  # bounded; a flat file becomes the header form; ConfigError names it
        return ConfigResult(config=config, path=f"{self.scheme()}://{path}", provider=self.provider, header=header)

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return config_path in ("", RECIPE_GROUP)

    def is_config(self, config_path: str) -> bool:
        path = self._file(config_path)  # a name that exists, even one that cannot be read: load_config says why
        return path is not None and os.path.lexists(path)

    def list(self, config_path: str, results_filter: object) -> List[str]:
        return []


class _RecipeFolderSource(_RecipeSourceBase):
    """`recipe/NAME` -> FOLDER/NAME.yaml (or .yml)."""

    @staticmethod
    def scheme() -> str:
        return _FOLDER_SCHEME

    def _file(self, config_path: str) -> Optional[Path]:
        group, _, name = config_path.partition("/")
        if group != RECIPE_GROUP or not name or is_path(name.removesuffix(".yaml")):
            return None
        stem = name.removesuffix(".yaml")
        for candidate in (Path(self.path, f"{stem}.yaml"), Path(self.path, f"{stem}.yml")):
            if os.path.lexists(candidate):
                return candidate
        return None

    def list(self, config_path: str, results_filter: object) -> List[str]:
        if config_path != RECIPE_GROUP:
            return []
        return sorted({p.stem for p in Path(self.path).iterdir() if p.suffix in (".yaml", ".yml")})


class _RecipeFileSource(_RecipeSourceBase):
    """`recipe/<path>` -> the file itself, relative paths against the working directory the search path saw."""

    @staticmethod
    def scheme() -> str:
        return _FILE_SCHEME

    def _file(self, config_path: str) -> Optional[Path]:
        group, _, value = config_path.partition("/")
        if group != RECIPE_GROUP or not value:
            return None
        if value.endswith(".yml.yaml"):  # Hydra appends .yaml to what it loads
            value = value.removesuffix(".yaml")
        if not is_path(value):
            return None
        if not value.endswith((".yaml", ".yml")):
            value += ".yaml"
        return Path(self.path, os.path.expanduser(value))


SOURCES = (_RecipeFolderSource, _RecipeFileSource)  # registered with Hydra by config/hydra_app.py
