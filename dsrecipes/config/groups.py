"""Discovery of config groups, options and recipes from the conf/ tree (never hand-listed)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from dsrecipes.paths import conf_dir

RECIPE_GROUP = "recipe"  # conf/recipe -> ../recipes


def group_options() -> Dict[str, List[str]]:
    """{group: [option, ...]} for every group directory under conf/ (the recipe group included)."""
    out: Dict[str, List[str]] = {}
    for d in sorted(p for p in conf_dir().iterdir() if p.is_dir()):
        options = sorted(f.stem for f in d.glob("*.yaml"))
        if options:
            out[d.name] = options
    return out


def recipes() -> List[str]:
    return group_options().get(RECIPE_GROUP, [])


def describe(group: str, option: str) -> str:
    """The first comment line of an option file (what it is / the command that runs it)."""
    path = Path(conf_dir(), group, f"{option}.yaml")
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if text.startswith("#") and not text.startswith("# @package"):
            return text.lstrip("# ").strip()
    return ""
