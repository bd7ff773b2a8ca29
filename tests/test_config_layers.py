"""Defaults live in one layer: the schema. The default composition is a bare TrainConfig(), and recipes only state
what differs from the groups they pick."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import pytest
import yaml

from dsrecipes.config.groups import recipes
from dsrecipes.config.load import check_composition, compose, compose_and_load, hydra_context
from dsrecipes.core.paths import conf_dir
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.typed import config_to_dict

RECIPES = recipes()


def test_the_default_composition_is_the_schema_default():
    assert RECIPES, "no recipes found"
    assert compose_and_load([]) == TrainConfig()


def _leaves(data: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def _get(data: Dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_repeat_no_value_their_groups_already_have(recipe):
    text = yaml.safe_load((conf_dir() / "recipe" / f"{recipe}.yaml").read_text(encoding="utf-8"))
    groups = [f"{k.split('/', 1)[1].strip()}={v}" for d in text.pop("defaults", []) for k, v in d.items()
              if k.startswith("override /")]
    with hydra_context():
        cfg, schema_errors, _ = check_composition(compose(groups), check_files=False)  # rules may need the recipe
    assert not schema_errors
    base = config_to_dict(cfg)
    defaults = {k: v for d in yaml.safe_load((conf_dir() / "train.yaml").read_text())["defaults"]
                if isinstance(d, dict) for k, v in d.items()}
    same = [g for g in groups if defaults.get(g.split("=")[0]) == g.split("=")[1]]
    assert not same, f"recipes/{recipe}.yaml overrides a group with its default option: {same}"
    assert text, f"{recipe}: a recipe that only picks groups"
    repeated = [f"{key}={value!r}" for key, value in _leaves(text) if _get(base, key) == value]
    assert not repeated, f"recipes/{recipe}.yaml repeats what {' '.join(groups) or 'the defaults'} already say: {repeated}"
