"""One dataset split across the steps of an experiment (DeepSpeed-Chat's `--data_split 2,4,4`): `dataset.split`.

    dataset.split.shares={sft: 2, reward: 4, rl: 4}   # named shares and their weights (whole numbers)
    dataset.split.take=reward                         # this run reads only the rows of that share
    dataset.split.pin={chat_only: sft}                # every row of source `chat_only` belongs to `sft`
                                                      # (DeepSpeed-Chat's --sft_only_data_path)

A row's share is a function of the row alone: its **row id** is the BLAKE2b hash of the canonical JSON of the row's
parsed value (keys sorted, no spaces, UTF-8), so it does not depend on the world size, on file names or paths, on
the order of files or of rows in a file, on whitespace or on key order inside the row. The hash picks a slot in
`sum(weights)`; slots are dealt to the shares in the order of their names (not the order they were written in).
Two identical rows are one row id and so always land in the same share: a duplicated example never crosses from
the SFT share into the reward share. A row that cannot be parsed is hashed on its text (or, when too large to
hold, its file:line); it is reported as bad only by the run whose share it falls into.

The filter sits where rows are read (`sharegpt.iter_checked`: map preparation, preference pairs, `dsrecipes shard`,
prompt-eval; `data=iterable`: the launching process's index leaves the other shares' lines out of the training order,
data/stream/shares.py), so the validation split (`dataset.val_size`) is drawn inside the share; `dataset.val_paths`
files are not split. data=presharded chooses the share when sharding (`dsrecipes shard ... dataset.split.take=NAME`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Dict, List, Optional

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import DataKind, DatasetConfig, ShareOfSource, SourceConfig, SplitConfig

_SALT = b"dsrecipes-split-v1"
MAX_SHARES = 64


def row_id(value: Any = None, text: Optional[str] = None, where: str = "") -> str:
    """The stable id of a row (see the module's opening comment): its parsed `value`, else its `text`, else `where`."""
    if value is not None:
        material = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    else:
        material = text if text is not None else f"(unreadable row) {where}"
    return hashlib.blake2b(material.encode("utf-8", "surrogatepass"), digest_size=16, key=_SALT).hexdigest()


def share_of_id(rid: str, shares: Dict[str, int]) -> str:
    """The share a row id falls into: slot `id mod sum(weights)`, slots dealt to the shares by name."""
    slot = int(rid, 16) % sum(shares.values())
    for name in sorted(shares):
        if slot < shares[name]:
            return name
        slot -= shares[name]
    raise AssertionError("unreachable: slot below the total weight")


def share_of_row(row: Any, share: ShareOfSource) -> str:
    """The share of one `files.RawRow` of a source (its pinned share, else by row id)."""
    if share.pinned is not None:
        return share.pinned
    if row.error is None:
        return share_of_id(row_id(row.value), share.shares)
    return share_of_id(row_id(None, row.raw_text, row.where), share.shares)


def keeps(row: Any, source: SourceConfig) -> bool:
    """Whether a run reads this row of `source`: no split, or the row is in the share the run takes."""
    share = source.share
    return share is None or share_of_row(row, share) == share.take


def stamp(split: SplitConfig, sources: List[SourceConfig]) -> List[SourceConfig]:
    """Sources with the run's share attached (`registry.resolve_sources`); unchanged without `dataset.split.take`."""
    if split.take is None:
        return sources
    names = {s.name for s in sources}
    unknown = sorted(set(split.pin) - names)
    if unknown:
        raise ConfigError(f"dataset.split.pin: no source named {unknown[0]!r} (sources: {', '.join(sorted(names))})")
    return [dataclasses.replace(s, share=ShareOfSource(dict(split.shares), split.take, split.pin.get(s.name)))
            for s in sources]


def with_take(dataset: DatasetConfig, take: str) -> DatasetConfig:
    """`dataset` reading share `take` (the audit reads every share in turn)."""
    return dataclasses.replace(dataset, split=dataclasses.replace(dataset.split, take=take))


def split_problems(ds: DatasetConfig, data_kind: DataKind) -> List[str]:
    """One line per problem of `dataset.split` (config/validate.py)."""
    sp, errors = ds.split, []
    if not sp.shares:
        if sp.take is not None or sp.pin:
            key = "dataset.split.pin" if sp.pin else "dataset.split.take"
            errors.append(f"{key}: names shares, so dataset.split.shares is needed "
                          "(e.g. dataset.split.shares={sft:2,reward:4,rl:4})")
        return errors
    if len(sp.shares) > MAX_SHARES:
        errors.append(f"dataset.split.shares: at most {MAX_SHARES} shares, got {len(sp.shares)}")
    for name, weight in sp.shares.items():
        if not str(name).isidentifier():
            errors.append(f"dataset.split.shares: share name {name!r} must be a plain name (letters, digits, _)")
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
            errors.append(f"dataset.split.shares.{name}: a whole number >= 1 (a weight, as in --data_split 2,4,4), "
                          f"got {weight!r}")
    known = ", ".join(sorted(sp.shares))
    if sp.take is None:
        errors.append(f"dataset.split.take: which share this run reads ({known})")
    elif sp.take not in sp.shares:
        errors.append(f"dataset.split.take: {sp.take!r} is not a share (shares: {known})")
    for source, share in sp.pin.items():
        if share not in sp.shares:
            errors.append(f"dataset.split.pin.{source}: {share!r} is not a share (shares: {known})")
    for i, src in enumerate(ds.sources):
        if src.share is not None:
            errors.append(f"dataset.sources[{i}].share: set from dataset.split, not per source "
                          "(pin a source with dataset.split.pin)")
    return errors
