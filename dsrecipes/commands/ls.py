"""`dsrecipes ls [GROUP ...]`: config groups with their options, and the recipes (shipped and the user's), each with
its whole description, wrapped to the terminal."""

from __future__ import annotations

import argparse
import shutil
import textwrap
from typing import List

from dsrecipes.commands.args import parse
from dsrecipes.config.groups import RECIPE_GROUP, describe, describe_file, group_options, option_file
from dsrecipes.core.errors import UserError
from dsrecipes.core.suggest import closest, phrase


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsrecipes ls", description="List config groups, their options and the "
                                     "recipes, each with its description.")
    parser.add_argument("groups", nargs="*", help="only these groups (e.g. `dsrecipes ls zero offload recipe`)")
    args = parse(parser, argv)
    from dsrecipes.config.sources import (  # lazy: else `commands.ls` imports hydra 0.12 s, omegaconf 0.06 s
        RECIPES_ENV,
        user_recipes,
    )

    options = group_options()
    for group in args.groups:
        if group not in options:
            raise UserError(f"no config group '{group}'{phrase(closest(group, options))} (groups: {', '.join(options)})")
    width = min(shutil.get_terminal_size((100, 24)).columns, 120)
    for group in args.groups or [g for g in options if g != RECIPE_GROUP] + [RECIPE_GROUP]:
        if group == RECIPE_GROUP:
            print(f"recipes (recipe=NAME from {option_file(RECIPE_GROUP, '*').parent}, or recipe=/path/to/file.yaml):")
        else:
            print(f"{group} ({group}=OPTION):")
        for option in options[group]:
            _print(option, describe(group, option), width)
        if group == RECIPE_GROUP:
            mine = user_recipes()
            print(f"your recipes (${RECIPES_ENV}):" + ("" if mine else " none"))
            for name, path in mine.items():
                _print(name, describe_file(path) + [f"  ({path})"], width)
    return 0


def _print(option: str, description: List[str], width: int) -> None:
    print(f"  {option}")
    for line in description or ["(no description)"]:
        if line.startswith("  "):  # a command or a snippet: verbatim, so it can be copied
            print(f"    {line}")
        else:
            print(textwrap.fill(line, width=width, initial_indent="    ", subsequent_indent="    ",
                                break_on_hyphens=False, break_long_words=False))
