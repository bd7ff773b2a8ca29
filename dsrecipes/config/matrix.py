"""Every recipe x every option of every group, fast: few real Hydra composes, layering for the products.

A Hydra compose costs ~0.1-0.25 s of CPU (defaults tree, file loads, structured merges), and `validate --all` checks
276 compositions. Composition is layering in the order of conf/train.yaml's defaults list: the schema, one option
per group (each under its group's key), then global options (`debug`), then the recipe's body. So `recipe=R g=o` is
R's composition with the whole `g` node replaced by option o's node, and R's own values for `g` applied on top
again (the command line chooses `g`, the recipe's values still win, as in Hydra); the defaults with `g=o` likewise,
with no recipe body.

The layers come from real composes: the defaults, each recipe alone, and the options in "rows" (one option of
every group per compose: groups are orthogonal packages, so each option's node comes out of its row untouched; a
row that fails is composed option by option, to name the file). Every file's defaults list, package and schema thus
go through Hydra itself; only the products are layered, on plain containers (dict merge, lists replaced, as
OmegaConf merges). Options that are not group-packaged (`# @package _global_`, e.g. debug) or pull other groups in
their defaults list are composed alone; with extra command-line overrides everything is composed for real.
tests/test_config.py checks the layering against real composes.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsrecipes.config.groups import RECIPE_GROUP, group_options
from dsrecipes.core.paths import conf_dir

Container = Dict[str, Any]
Option = Tuple[str, str]  # (group, option)
_PACKAGE = re.compile(r"^#\s*@package\s+(\S+)", re.MULTILINE)


@dataclass
class Check:
    """One composition `validate --all` reports on: `overrides` as the user would type them."""

    overrides: List[str]
    rules_fatal: bool  # a base (the defaults or a recipe alone) must pass the rules; products may be rejected
    base: str = ""  # recipe name ("" = the defaults)
    option: Optional[Option] = None  # layered onto the base (None: the base alone)
    real: bool = False  # composed by Hydra itself (key = overrides)


@dataclass
class Plan:
    composes: List[List[str]]  # real Hydra composes
    checks: List[Check]
    sources: Dict[Option, List[str]]  # the compose each option's node is taken from


def plan_all(extra: List[str]) -> Plan:
    options = {g: opts for g, opts in group_options().items() if g != RECIPE_GROUP}
    recipes = group_options().get(RECIPE_GROUP, [])
    bases = [""] + recipes
    checks: List[Check] = []
    for base in bases:
        base_ov = ([f"{RECIPE_GROUP}={base}"] if base else []) + extra
        checks.append(Check(base_ov, True, base, None, True))
        layerable = not extra and (not base or _recipe_layerable(base, options))
        for group, opts in options.items():
            checks += [Check(base_ov + [f"{group}={o}"], False, base, (group, o), not layerable) for o in opts]
    composes = [c.overrides for c in checks if c.real]
    sources: Dict[Option, List[str]] = {}
    if any(not c.real for c in checks):
        rows, singles = option_rows(options)
        for row in rows:
            composes.append([f"{g}={o}" for g, o in row])
            sources.update({opt: composes[-1] for opt in row})
        for opt in singles:
            composes.append([f"{opt[0]}={opt[1]}"])
            sources[opt] = composes[-1]
    return Plan(composes, checks, sources)


def option_rows(options: Dict[str, List[str]]) -> Tuple[List[List[Option]], List[Option]]:
    """Options composed together, one per group (rows), and those composed alone."""
    alone = [(g, o) for g, opts in options.items() for o in opts if package_of(g, o) != g or pulls_groups(g, o)]
    rowed = {g: [o for o in opts if (g, o) not in alone] for g, opts in options.items()}
    depth = max((len(v) for v in rowed.values()), default=0)
    rows = [[(g, opts[i]) for g, opts in rowed.items() if i < len(opts)] for i in range(depth)]
    return rows, alone


def as_container(composed: Any) -> Container:
    """A Hydra composition as plain data, Hydra's own `hydra` node dropped: what `layer` takes and returns."""
    from omegaconf import OmegaConf  # lazy: else `commands.validate` imports omegaconf 0.06 s

    data = OmegaConf.to_container(composed, resolve=True, enum_to_str=True)
    data.pop("hydra", None)
    return data


def layer(base: Container, group: str, option: str, option_cfg: Container, recipe: Container) -> Container:
    """`base` (the defaults' or a recipe's composition) with `group=option`: the option's node (or global body),
    then the recipe's body again."""
    out = copy.deepcopy(base)
    if package_of(group, option) == "_global_":
        merge_into(out, option_body(group, option))
    else:
        out[group] = copy.deepcopy(option_cfg[group])
    merge_into(out, recipe)
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
    return _body(conf_dir() / RECIPE_GROUP / f"{name}.yaml") if name else {}


@functools.lru_cache(maxsize=None)
def option_body(group: str, option: str) -> Container:
    return _body(conf_dir() / group / f"{option}.yaml")


@functools.lru_cache(maxsize=None)
def package_of(group: str, option: str) -> str:
    """The package a file's body lands in: its `# @package` header, else its group (Hydra 1.1+ default)."""
    found = _PACKAGE.search((conf_dir() / group / f"{option}.yaml").read_text(encoding="utf-8"))
    return found.group(1) if found else group


@functools.lru_cache(maxsize=None)
def pulls_groups(group: str, option: str) -> bool:
    """Whether the option's defaults list names anything but its schema (then it is composed alone)."""
    from omegaconf import OmegaConf  # lazy: else `commands.validate` imports omegaconf 0.06 s

    entries = OmegaConf.to_container(OmegaConf.load(conf_dir() / group / f"{option}.yaml")).get("defaults") or []
    return any(not (e == "_self_" or isinstance(e, str) and e.startswith("/schema/")) for e in entries)


def _recipe_layerable(name: str, options: Dict[str, List[str]]) -> bool:
    """A global body, and no global option chosen by the recipe itself (its layer could not be replaced)."""
    if package_of(RECIPE_GROUP, name) != "_global_":
        return False
    text = (conf_dir() / RECIPE_GROUP / f"{name}.yaml").read_text(encoding="utf-8")
    globals_ = [g for g, opts in options.items() if any(package_of(g, o) == "_global_" for o in opts)]
    return not any(re.search(rf"^\s*-\s*(override\s+)?/?{g}\s*:", text, re.MULTILINE) for g in globals_)


def _body(path: Path) -> Container:
    from omegaconf import OmegaConf  # lazy: else `commands.validate` imports omegaconf 0.06 s

    node = OmegaConf.load(path)
    data = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    data.pop("defaults", None)
    return data
