"""YAML someone else wrote, parsed with bounded work: aliases expanded, a document holds at most MAX_VALUES values.

PyYAML shares an aliased node instead of copying it, so an alias bomb (nine lines whose aliases expand to 9^9
values) parses in microseconds; whatever walks the result afterwards (typing it, printing it, hashing it) walks every
expansion. The size is counted on the node graph, each shared node once, before anything is constructed: recipe
files (config/recipe_file.py) and dataset registries (data/sources/registry.py) are read through it.
"""

from __future__ import annotations

from typing import Any, Dict, List

import yaml

MAX_VALUES = 100_000  # scalars, mappings and lists after alias expansion


class SelfReference(Exception):
    """An alias inside the value it names (its value would be infinite); args[0]: the line."""

    def __init__(self, node: Any):
        super().__init__(node.start_mark.line + 1)


class TooLarge(Exception):
    """A document whose aliases expand past MAX_VALUES values."""


def expanded_size(node: Any, memo: Dict[int, int]) -> int:
    """Values of `node` with every alias expanded: shared nodes are counted once per use, computed once."""
    known = memo.get(id(node))
    if known is not None:
        return known
    if isinstance(node, yaml.MappingNode):
        children: List[Any] = [part for pair in node.value for part in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    memo[id(node)] = -1  # on the current path: an alias to it would make the value infinite
    total = 1
    for child in children:
        if memo.get(id(child)) == -1:
            raise SelfReference(child)
        total += expanded_size(child, memo)
    memo[id(node)] = total
    return total


def safe_load(text: str) -> Any:
    """yaml.safe_load of `text` once its expanded size is within MAX_VALUES: TooLarge or SelfReference otherwise
    (yaml.YAMLError for text that is not YAML)."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is not None and expanded_size(node, {}) > MAX_VALUES:
        raise TooLarge(f"its YAML aliases (*name) expand to more than {MAX_VALUES} values")
    return yaml.safe_load(text)
