"""The validation split and the per-source mixing weights of a preparation (deterministic for a seed), one
implementation for every row kind (conversations: prepare.py, preference pairs: preference_prepare.py)."""

from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple

from dsrecipes.core.errors import DataError


def split_val(n: int, val_size: float, seed: int) -> List[int]:
    """Positions (sorted) of the validation samples among n kept samples."""
    if val_size <= 0:
        return []
    k = int(val_size) if val_size >= 1 else max(1, round(n * val_size))
    if k >= n:
        raise DataError(f"dataset.val_size: {k} validation samples leave nothing to train on ({n} usable samples); "
                        f"set dataset.val_size to a fraction (0.1), a count below {n}, or 0 for no validation")
    return sorted(random.Random(seed).sample(range(n), k))


def split_and_mix(pool: Sequence[int], held: Sequence[int], source_of: Sequence[str], weights: Dict[str, float],
                  val_size: float, seed: int) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """(training items, validation items) of a preparation. `pool`: the kept samples of the training sources;
    `held`: those of `dataset.val_paths`, which are then the whole validation split (`val_size` unused), else
    `val_size` of the pool is held out. Validation items are never copied; the training part is mixed by weight."""
    if len(held):
        val_items = [(int(i), 0) for i in held]
        members = [int(i) for i in pool]
    else:
        pick = split_val(len(pool), val_size, seed)
        val_items = [(int(pool[j]), 0) for j in pick]
        in_val = set(pick)
        members = [int(pool[j]) for j in range(len(pool)) if j not in in_val]
    return mix(members, source_of, weights, seed), val_items


def mix(members: Sequence[int], source_of: Sequence[str], weights: Dict[str, float], seed: int) -> List[Tuple[int, int]]:
    """Training items (conversation index, copy number) after per-source weights, sources in first-seen order."""
    by_source: Dict[str, List[int]] = {}
    for i in members:
        by_source.setdefault(source_of[i], []).append(i)
    items: List[Tuple[int, int]] = []
    for name, idx in by_source.items():
        target = round(weights.get(name, 1.0) * len(idx))
        full, rest = divmod(target, len(idx))
        for copy in range(full):
            items += [(i, copy) for i in idx]
        if rest:
            chosen = sorted(random.Random(f"{seed}:{name}").sample(range(len(idx)), rest))
            items += [(idx[j], full) for j in chosen]
    return items

