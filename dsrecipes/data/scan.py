"""Check a stream before any rank starts (data=iterable): every row is read and normalised once, no tokenization.

The ranks stream the same files later and apply the same bad-row policy, but a worker that meets a bad row deep in
the stream can neither stop the others cleanly nor write the quarantine: this scan makes `bad_rows=error` stop at
the first bad row with `file:line: reason` before any process group exists, and makes `bad_rows=skip` write
`<run>/quarantine.jsonl` and enforce `dataset.max_bad_fraction`. Opt out with `data.prescan=false` for streams
too large to read twice.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict

from dsrecipes.config.schema import TrainConfig
from dsrecipes.data.badrows import BadRowReport
from dsrecipes.data.prepare import QUARANTINE_FILE
from dsrecipes.data.sharegpt import iter_conversations


def scan_stream(cfg: TrainConfig, run_dir: Path) -> Dict[str, int]:
    """Read every source row once under the bad-row policy; returns {'rows': read, 'good': kept, 'skipped': bad}."""
    quarantine = Path(run_dir) / QUARANTINE_FILE
    quarantine.unlink(missing_ok=True)
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, quarantine_path=quarantine)
    good = sum(1 for _ in iter_conversations(cfg.dataset, report=report))
    report.check()
    counts = {"rows": report.rows_read, "good": good, "skipped": report.skipped}
    print(f"data: stream scanned: {report.rows_read} rows, {good} good, bad: {report.summary()}"
          + (f" (quarantined in {quarantine})" if report.skipped else ""), file=sys.stderr)
    return counts
