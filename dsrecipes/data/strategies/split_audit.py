"""`dsrecipes audit` with `dataset.split.shares`: proof that the shares are disjoint and cover the data.

Each share is read the way a run taking it reads (`registry.resolve_sources` stamps the share on every source,
`sharegpt.iter_checked` leaves out the other shares' rows), with the row checks replaced by the row id
(split_shares.row_id), then compared with every row of the sources read without a split: no row id in two shares
(disjoint), and the shares' rows together are exactly the dataset's rows, duplicates counted (covering). Caps
(`max_samples`) are lifted here: they cut each share's run after the split, so a capped run reads less than its
share by design. Validation files (`dataset.val_paths`) are not split and not audited here. Under `data=iterable`
each share is read as its run's index reads it (stream/shares.py: the lines it leaves in the training order).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from dsrecipes.core.choices import BadRows
from dsrecipes.core.schema import DataKind, DatasetConfig, SplitConfig, TrainConfig
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.sharegpt import iter_checked
from dsrecipes.data.sources.split_shares import row_id, with_take
from dsrecipes.data.stream.index import BlockSource, index_stream
from dsrecipes.data.stream.shares import outside_of, rows_of


@dataclass
class SplitAudit:
    shares: Dict[str, int]
    rows: Dict[str, Counter] = field(default_factory=dict)  # share -> row id -> rows read by that share's run
    total: Counter = field(default_factory=Counter)  # row id -> rows of the dataset read without a split
    violations: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def render(self) -> str:
        weight = sum(self.shares.values())
        n = sum(self.total.values())
        lines = [f"audit dataset.split: {n} rows, {len(self.total)} distinct row ids, shares "
                 + ", ".join(f"{k}={v}" for k, v in sorted(self.shares.items()))]
        for name in sorted(self.shares):
            got = sum(self.rows[name].values())
            lines.append(f"  {name:<12} {got:>8} rows ({got / max(n, 1):.1%}; weight {self.shares[name] / weight:.1%})")
        lines += [f"VIOLATION: {v}" for v in self.violations[:20]]
        lines.append("OK: the shares are disjoint and cover every row" if self.ok
                     else f"FAILED: {len(self.violations)} violation(s)")
        return "\n".join(lines)


def audit_split(dataset: DatasetConfig, cfg: Optional[TrainConfig] = None) -> SplitAudit:
    """Read every share and the whole dataset (see the module's opening comment); `cfg`: the run's config, whose
    data strategy reads the shares (default: as data=map)."""
    uncapped = _uncapped(dataset)
    audit = SplitAudit(dict(dataset.split.shares))
    read = _ids
    if cfg is not None and cfg.data.kind is DataKind.iterable:
        read = lambda ds: _stream_ids(dataclasses.replace(cfg, dataset=ds))  # noqa: E731
    for name in sorted(dataset.split.shares):
        audit.rows[name] = read(with_take(uncapped, name))
    audit.total = read(dataclasses.replace(uncapped, split=SplitConfig()))
    owner: Dict[str, str] = {}
    for name, ids in audit.rows.items():
        for rid in ids:
            if rid in owner:
                audit.violations.append(f"row {rid} is in share {owner[rid]!r} and in share {name!r}")
            owner[rid] = name
    union = sum(audit.rows.values(), Counter())
    if union != audit.total:
        missing, extra = audit.total - union, union - audit.total
        audit.violations.append(f"the shares hold {sum(union.values())} rows, the dataset {sum(audit.total.values())} "
                                f"({sum(missing.values())} in no share, {sum(extra.values())} not in the dataset)")
    return audit


def _uncapped(dataset: DatasetConfig) -> DatasetConfig:
    return dataclasses.replace(dataset, max_samples=None,
                               sources=[dataclasses.replace(s, max_samples=None) for s in dataset.sources])


def _ids(dataset: DatasetConfig) -> Counter:
    report = BadRowReport(BadRows.skip, 1.0)
    ids: Counter = Counter()
    for source in resolve_sources(dataset):
        source = dataclasses.replace(source, max_samples=None)
        ids.update(iter_checked(source, report, None, dataset.max_row_bytes, _row_id))
    return ids


def _stream_ids(cfg: TrainConfig) -> Counter:
    """Row ids of the lines a data=iterable run's index keeps in its training order or holds out for validation."""
    index = index_stream(cfg)
    source, ids, base = BlockSource(index, cfg.dataset.max_row_bytes), Counter(), 0
    try:
        for f in index.train_files:
            other = outside_of(index, base, index.caps[f])
            rows = itertools.islice(rows_of(source, f, cfg.dataset.max_row_bytes), index.caps[f])
            ids.update(_row_id(row, None, None) for n, row in enumerate(rows) if n not in other)
            base += index.caps[f]
    finally:
        source.close()
    return ids


def _row_id(row: Any, source: Any, table: Any) -> str:
    return row_id(row.value) if row.error is None else row_id(None, row.raw_text, row.where)
