"""Index and check a stream before any rank starts (data=iterable).

`prepare_stream` is the launching process's part of `data=iterable`: it indexes the files (stream_index.py: blocks,
caps, held-out validation rows; JSON arrays and gzip converted once), scans them when `data.prescan` is on,
writes the index into the run directory and returns the samples of one epoch, which the run plan records
(`RunPlan.rows`) and every rank checks.

The scan reads every row once (training and validation rows) with the same per-row checks as the loaders
(`strategies.rows.parse_item`), no tokenization: the ranks stream the same rows later under the same bad-row policy,
but a worker that meets a bad row deep in the stream can neither stop the others cleanly nor write the quarantine.
So `bad_rows=error` stops at the first bad row with `file:line: reason` before any process group exists, and
`bad_rows=skip` writes `<run>/quarantine.jsonl` and enforces `dataset.max_bad_fraction`. Opt out with
`data.prescan=false` for streams too large to read twice (indexing still reads every byte once, cached by content).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

from dsrecipes.config.schema import TrainConfig
from dsrecipes.data.badrows import BadReason, BadRow, BadRowReport
from dsrecipes.data.prepare import QUARANTINE_FILE
from dsrecipes.data.stream_index import (
    BlockSource,
    StreamIndex,
    file_sources,
    hold_out,
    index_stream,
    write_stream_index,
)
from dsrecipes.errors import DataError


def prepare_stream(cfg: TrainConfig, run_dir: Path) -> Tuple[int, str]:
    """(samples per epoch, data fingerprint) of a stream; writes `<run>/stream_index.*` (and the quarantine)."""
    from dsrecipes.data.cache import data_fingerprint
    from dsrecipes.data.registry import resolve_sources

    started = time.perf_counter()
    index = index_stream(cfg)
    if cfg.data.prescan:
        scan_stream(cfg, run_dir, index)
    hold_out(index, cfg)  # after the scan: a bad row is reported as such, not as too little data
    write_stream_index(run_dir, index)
    total = index.table().epoch_length()
    rows = total if cfg.data.num_samples is None else cfg.data.num_samples
    if rows > total:
        raise DataError(f"data.num_samples={rows} but the stream has {total} training samples per epoch; "
                        f"set data.num_samples={total} or leave it unset")
    blocks = int(index.blocks["count"].size)
    print(f"data: stream indexed: {len(index.files)} files, {index.num_lines} lines in {blocks} blocks of "
          f"~{index.block_bytes} bytes, {index.num_val} validation rows, {rows} training samples per epoch "
          f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return rows, data_fingerprint(cfg, resolve_sources(cfg.dataset))


def scan_stream(cfg: TrainConfig, run_dir: Path, index: Optional[StreamIndex] = None) -> Dict[str, int]:
    """Read every row once under the bad-row policy; returns {'rows': read, 'good': kept, 'skipped': bad}."""
    from dsrecipes.data.sharegpt import role_table
    from dsrecipes.data.strategies.rows import parse_item

    index = index_stream(cfg) if index is None else index
    quarantine = Path(run_dir) / QUARANTINE_FILE
    quarantine.unlink(missing_ok=True)
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, quarantine_path=quarantine)
    source = BlockSource(index)
    good = 0
    for f, (fi, src) in enumerate(zip(index.files, file_sources(cfg, index))):
        table = role_table(src)
        if fi.problem is not None:
            report.rows_read += 1
            report.add(fi.name, None, BadRow(BadReason(fi.problem[0]), fi.problem[1]))
            continue
        for local in range(fi.offsets.size):
            end = min(int(fi.firsts[local + 1]) if local + 1 < fi.offsets.size else fi.count, index.caps[f])
            if end <= int(fi.firsts[local]):
                break
            for loc, raw in source.samples(f, local, end - int(fi.firsts[local])):
                report.rows_read += 1
                try:
                    conv = parse_item(raw, fi.name, loc, src, table)
                except BadRow as bad:
                    report.add(fi.name, loc, bad, _raw_text(raw))
                    continue
                report.trailing_turns_dropped += conv.dropped_turns > 0
                good += 1
    source.close()
    report.check()
    counts = {"rows": report.rows_read, "good": good, "skipped": report.skipped}
    print(f"data: stream scanned: {report.rows_read} rows, {good} good, bad: {report.summary()}"
          + (f" (quarantined in {quarantine})" if report.skipped else ""), file=sys.stderr)
    return counts


def _raw_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r\n")
