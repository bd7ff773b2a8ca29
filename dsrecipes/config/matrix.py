"""Every recipe x every option of every group, fast: one real Hydra compose per file, layering for the products.

A Hydra compose costs ~0.1-0.25 s of CPU (defaults tree, file loads, structured merges), and `validate --all` needs
276 compositions. Composition is layering in the order of conf/train.yaml's defaults list: the schema, one option
per group (each under its group's key), then global options (`debug`), then the recipe's body, so
`recipe=R g=o` is R's composition with the whole `g` node replaced by option o's node, and R's own values for `g`
applied on top again (the command line chooses `g`, the recipe's values still win, as in Hydra). Those node and
body layers come from real composes: the defaults, each recipe, each option on the defaults (so every file's
defaults list, package and schema are exercised by Hydra itself); only the products are layered, on plain
containers (dict merge, lists replaced, as OmegaConf merges).

Falls back to a real compose wherever the layering does not apply: extra command-line overrides, a recipe whose body
is not `@package _global_` or that picks a global option itself, and an option file with an explicit package other
than `_global_`. tests/test_config.py checks the layering against real composes.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsrecipes.config.groups import RECIPE_GROUP, group_options
from dsrecipes.paths import conf_dir

Container = Dict[str, Any]
_PACKAGE = re.compile(r"^#\s*@package\s+(\S+)", re.MULTILINE)


@dataclass
class Job:
    """One composition to check: `overrides` as the user would type them; `base`/`option` when it is layered."""

    overrides: List[str]
    rules_fatal: bool  # a base (the defaults or a recipe alone) must pass the rules; products may be rejected
    base: Optional[str] = None  # recipe name, or "" for the defaults
    option: Optional[Tuple[str, str]] = None  # (group, option) layered onto the base
    real: bool = True  # composed by Hydra (else layered from real composes)


@dataclass
class Plan:
    jobs: List[Job] = field(default_factory=list)

    def real(self) -> List[Job]:
        return [j for j in self.jobs if j.real]


def plan_all(extra: List[str]) -> Plan:
    """Every base (the defaults, each recipe) alone and with each option of each other group."""
    options = {g: opts for g, opts in group_options().items() if g != RECIPE_GROUP}
    recipes = group_options().get(RECIPE_GROUP, [])
    plan = Plan()
    layered_ok = not extra
    for base in [""] + recipes:
        base_ov = ([f"{RECIPE_GROUP}={base}"] if base else []) + extra
        plan.jobs.append(Job(base_ov, True, base, None, True))
        recipe_ok = layered_ok and (not base or _recipe_layerable(base, options))
        for group, opts in options.items():
            for opt in opts:
                real = not base or not recipe_ok or package_of(group, opt) not in (group, "_global_")
                plan.jobs.append(Job(base_ov + [f"{group}={opt}"], False, base, (group, opt), real))
    return plan


def layer(base: Container, group: str, option: str, option_cfg: Container, recipe_body: Container) -> Container:
    """`base` (a recipe's composition) with `group=option`: the option's node (or global body), then the recipe's."""
    out = copy.deepcopy(base)
    if package_of(group, option) == "_global_":
        merge_into(out, option_body(group, option))
    else:
        out[group] = copy.deepcopy(option_cfg[group])
    merge_into(out, recipe_body)
    return out


def merge_into(dst: Container, src: Container) -> None:
    """OmegaConf's merge on plain containers: mappings merge key by key, anything else (lists too) replaces."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            merge_into(dst[key], value)
        else:
            dst[key] = copy.deepcopy(value)


@functools.lru_cache(maxsize=None)
def recipe_body(name: str) -> Container:
    return _body(conf_dir() / RECIPE_GROUP / f"{name}.yaml")


@functools.lru_cache(maxsize=None)
def option_body(group: str, option: str) -> Container:
    return _body(conf_dir() / group / f"{option}.yaml")


@functools.lru_cache(maxsize=None)
def package_of(group: str, option: str) -> str:
    """The package a file's body lands in: its `# @package` header, else its group (Hydra 1.1+ default)."""
    found = _PACKAGE.search((conf_dir() / group / f"{option}.yaml").read_text(encoding="utf-8"))
    return found.group(1) if found else group


def _recipe_layerable(name: str, options: Dict[str, List[str]]) -> bool:
    """A global body, and no global option chosen by the recipe itself (its layer could not be replaced)."""
    if package_of(RECIPE_GROUP, name) != "_global_":
        return False
    text = (conf_dir() / RECIPE_GROUP / f"{name}.yaml").read_text(encoding="utf-8")
    globals_ = [g for g, opts in options.items() if any(package_of(g, o) == "_global_" for o in opts)]
    return not any(re.search(rf"^\s*-\s*(override\s+)?/?{g}\s*:", text, re.MULTILINE) for g in globals_)


def _body(path: Path) -> Container:
    from omegaconf import OmegaConf

    node = OmegaConf.load(path)
    data = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    data.pop("defaults", None)
    return data
