"""`dsrecipes ls`: config groups with their options, and the recipes, each with its one-line description."""

from __future__ import annotations

from typing import List

from dsrecipes.config.groups import RECIPE_GROUP, describe, group_options


def main(argv: List[str]) -> int:
    options = group_options()
    for group, opts in options.items():
        if group == RECIPE_GROUP:
            continue
        print(f"{group}:")
        for opt in opts:
            print(f"  {opt:<24} {describe(group, opt)}")
    print("recipes (recipe=NAME, files in recipes/):")
    for opt in options.get(RECIPE_GROUP, []):
        print(f"  {opt:<36} {describe(RECIPE_GROUP, opt)}")
    return 0
