"""Discovery of config groups, options and recipes from the conf/ tree (never hand-listed), and their descriptions.

An option's description is the comment block its file opens with (after `# @package`): prose lines, and lines
indented by two spaces or more after `#`, which are commands to run.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Dict, List

from dsrecipes.core.errors import visible
from dsrecipes.core.paths import conf_dir

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
    """The shipped recipes (user recipes: config/sources.py `user_recipes()`)."""
    return group_options().get(RECIPE_GROUP, [])


def option_file(group: str, option: str) -> Path:
    return Path(conf_dir(), group, f"{option}.yaml")


def describe(group: str, option: str) -> List[str]:
    """The description of an option: its file's opening comment block (see the module docstring)."""
    return describe_file(option_file(group, option))


def describe_file(path: Path) -> List[str]:
    """Paragraph lines joined into one, command lines (indented after `#`) kept apart; [] when there is none."""
    out: List[str] = []
    try:  # the opening comment is in the first lines (a user's recipe folder may hold anything: read a bounded head)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO named *.yaml: open() would wait for a writer
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return ["(not a regular file, so not a recipe)"]
        with open(fd, encoding="utf-8", errors="replace") as fh:
            head = fh.read(65536)
    except OSError as exc:
        return [f"(cannot be read: {exc.strerror or exc})"]
    for line in head.splitlines():
        text = line.strip()
        if text.startswith("# @package") or (not out and not text):
            continue
        if not text.startswith("#"):
            break
        body = text[1:]
        if body.startswith("   ") or not out or out[-1].startswith("  "):
            out.append("  " + body.strip() if body.startswith("   ") else body.strip())
        else:
            out[-1] = f"{out[-1]} {body.strip()}".strip()
    # a shared recipe's comment goes to a terminal: escape sequences (title, clipboard, cursor) shown escaped
    return [visible(line) for line in out if line.strip()]
