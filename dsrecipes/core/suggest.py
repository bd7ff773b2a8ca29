"""Did you mean: the closest valid names to a mistyped one, by edit distance (typos, a letter missing or swapped).

Used for subcommands, flags, config keys, groups, options and enum values alike, so every such mistake ends in one
message that names what the user probably meant.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence


def distance(a: str, b: str) -> int:
    """Edit distance counting an insertion, deletion, substitution or swap of neighbours as one edit."""
    prev2: List[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _limit(word: str) -> int:
    """How many edits still count as a typo of `word` (1 for short words, up to 3)."""
    return max(1, min(3, len(word) // 3))


def _plain(name: str) -> str:
    return name.lower().replace(".", "_").replace("-", "_")


def closest(word: str, candidates: Iterable[str], limit: int = 3) -> List[str]:
    """Up to `limit` candidates within a typo's distance of `word`, closest first; then those that begin with it
    (3 characters or more, `.` and `-` read as `_`): `model=smollm2` -> smollm2_135m, `model=qwen2.5` -> qwen2_5_0_5b,
    `offload=cpu` -> cpu_optimizer, cpu_optimizer_params. A number names the candidates ending in it: `zero=3` -> stage3."""
    scored = sorted((distance(word.lower(), c.lower()), c) for c in set(candidates) if c != word)
    if word.isdigit():  # `zero=3` -> stage3, `precision=32` -> fp32
        return [c for _, c in scored if c.endswith(word)][:limit]
    near = [c for d, c in scored if d <= _limit(word)]
    longer = sorted(c for _, c in scored if len(word) >= 3 and _plain(c).startswith(_plain(word)) and c not in near)
    return (near + longer)[:limit]


def closest_keys(typed: str, keys: Sequence[str], limit: int = 3) -> List[str]:
    """Dotted keys closest to `typed`: the whole key with a typo (`trainr.max_steps`), a sibling with a typo
    (`trainer.max_step`), or the same name under another parent (`trainer.lr` -> `optimizer.lr`)."""
    parent, _, leaf = typed.rpartition(".")
    scored = []
    for key in set(keys):
        key_parent, _, key_leaf = key.rpartition(".")
        leaf_score = distance(leaf.lower(), key_leaf.lower()) + (0 if key_parent == parent else 1)
        score = min(distance(typed.lower(), key.lower()), leaf_score)
        if score <= _limit(leaf) and key != typed:
            scored.append((score, key))
    return [k for _, k in sorted(scored)][:limit]


def phrase(names: Sequence[str], quote: str = "") -> str:
    """'; did you mean X?' / '; did you mean X or Y?' ('' when there is nothing close)."""
    if not names:
        return ""
    quoted = [f"{quote}{n}{quote}" for n in names]
    text = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"; did you mean {text}?"
