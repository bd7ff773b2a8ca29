"""`prepare(cfg, tokenizer, run_dir)`: sources -> checked conversations -> split -> mix -> tokens -> cached Arrow.

Runs once, in the launching process, before any process group. Ranks call `load_prepared(cfg, run_dir)`, which
re-opens the cache named in `<run>/prepare_stats.json` (memory-mapped Arrow) without reading sources.

Order of operations (all deterministic for a config, data and `trainer.seed`):
1. read every source (`dataset.paths`, `sources`, registry `use`) in order; caps: `sources[i].max_samples` /
   registry `num_samples` (first N good rows of that source), `dataset.max_samples` (first N over all sources);
   bad rows per `dataset.bad_rows` (quarantine in `<run>/quarantine.jsonl`).
2. tokenize everything (batched, `data.preprocess_workers` processes); samples whose trained tokens are all cut
   by `data.cutoff_len` are dropped and counted.
3. validation split over the kept samples: `dataset.val_size` < 1 is a fraction (rounded, at least 1), >= 1 a count;
   a seeded random choice (`trainer.seed`) kept in data order. Validation samples are never weighted or copied.
4. mixing weights on the training part, per source: `weight` w turns n samples into round(w * n): floor copies of
   every sample, plus a seeded choice of the remainder (w < 1 is a seeded subsample). Copy k >= 1 of a sample gets
   the id `<id>@<k>`, so every training row is unique. The weight scales a source, it is not a probability.
5. packing (`data.packing`) of each split, best-fit-decreasing; else one row per sample.

Cache: `<data.cache_dir or $XDG_CACHE_HOME/dsrecipes>/prepared/<key>`, key = hash of the input files' contents
(hashes memoised by path + size + mtime), the dataset/template config, cutoff_len, packing, train_on, seed and the
tokenizer itself (vocabulary, merges, special tokens, chat_template). The directory is written beside and renamed
into place, so concurrent runs never see half a cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.config.load import config_to_dict
from dsrecipes.config.schema import TrainConfig
from dsrecipes.data.registry import resolve_sources
from dsrecipes.data.sharegpt import (
    BadRow,
    BadRowReport,
    Conversation,
    conversation_dict,
    expand_paths,
    iter_conversations,
)
from dsrecipes.data.tokenize import IGNORE_INDEX, Encoder, pack_plan, packing_efficiency
from dsrecipes.errors import DataError

PREP_VERSION = 1  # bump when the output of preparation changes for the same inputs
CHUNK = 512  # conversations per tokenization task
STATS_FILE = "prepare_stats.json"
QUARANTINE_FILE = "quarantine.jsonl"


@dataclass
class Prepared:
    train: Any  # datasets.Dataset: ids (list[str]), input_ids, labels, position_ids (list[int32])
    val: Any  # datasets.Dataset, or None when dataset.val_size is 0
    stats: Dict[str, Any]
    cache_dir: Path


def prepare(cfg: TrainConfig, tokenizer: Any, run_dir: str | Path) -> Prepared:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(cfg, tokenizer)
    root = cache_root(cfg) / "prepared"
    final = root / key
    hit = (final / "done").is_file()
    quarantine = run_dir / QUARANTINE_FILE
    quarantine.unlink(missing_ok=True)  # never leave an older run's list beside this run's data
    if hit:
        if (final / QUARANTINE_FILE).is_file():
            shutil.copyfile(final / QUARANTINE_FILE, quarantine)
    else:
        _build(cfg, tokenizer, key, root, final, quarantine)
    stats = json.loads((final / STATS_FILE).read_text(encoding="utf-8"))
    stats.update(cache_dir=str(final), cache_hit=hit)
    if quarantine.is_file():
        stats["quarantine"] = str(quarantine)
    _write_json(run_dir / STATS_FILE, stats)
    print(summary(stats), file=sys.stderr)
    return _open(final, stats)


def load_prepared(cfg: TrainConfig, run_dir: str | Path) -> Prepared:
    """Re-open what `prepare` wrote for this run (on each rank); never reads the sources."""
    path = Path(run_dir) / STATS_FILE
    if not path.is_file():
        raise DataError(f"{path}: missing; the launching process runs prepare() before starting ranks")
    stats = json.loads(path.read_text(encoding="utf-8"))
    cache = Path(stats["cache_dir"])
    if not (cache / "done").is_file():
        raise DataError(f"{cache}: prepared data is gone (cache cleared?); start the run again to re-prepare")
    for name, want in (("cutoff_len", cfg.data.cutoff_len), ("packing", cfg.data.packing)):
        if stats[name] != want:
            raise DataError(f"{path}: prepared with data.{name}={stats[name]}, but this config has {want}")
    return _open(cache, stats)


def _open(cache: Path, stats: Dict[str, Any]) -> Prepared:
    from datasets import load_from_disk

    train = load_from_disk(str(cache / "train"))
    val = load_from_disk(str(cache / "val")) if (cache / "val").is_dir() else None
    return Prepared(train, val, stats, cache)


# ----------------------------------------------------------------------------------------------------------------
# Cache key


def cache_root(cfg: TrainConfig) -> Path:
    if cfg.data.cache_dir:
        return Path(os.path.expanduser(cfg.data.cache_dir))
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsrecipes"


def cache_key(cfg: TrainConfig, tokenizer: Any) -> str:
    memo_path = cache_root(cfg) / "file_hashes.json"
    memo = _read_memo(memo_path)
    sources = []
    for src in resolve_sources(cfg.dataset):
        files, missing = expand_paths(src.paths)
        sources.append({"name": src.name, "files": [[f, file_hash(f, memo)] for f in files], "missing": missing})
    _write_memo(memo_path, memo)
    material = {
        "version": PREP_VERSION,
        "dataset": config_to_dict(cfg.dataset),
        "sources": sources,
        "template": config_to_dict(cfg.template),
        "data": {k: config_to_dict(getattr(cfg.data, k)) for k in ("cutoff_len", "packing", "train_on")},
        "seed": cfg.trainer.seed,
        "tokenizer": tokenizer_fingerprint(tokenizer),
    }
    return hashlib.blake2b(json.dumps(material, sort_keys=True).encode(), digest_size=12).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    extra = [type(tokenizer).__name__, getattr(tokenizer, "chat_template", None), tokenizer.bos_token,
             tokenizer.eos_token, tokenizer.pad_token]
    h.update(json.dumps(extra, default=str).encode())
    return h.hexdigest()


def file_hash(path: str, memo: Dict[str, str]) -> str:
    st = os.stat(path)
    memo_key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    if memo_key not in memo:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        memo[memo_key] = h.hexdigest()
    return memo[memo_key]


def _read_memo(path: Path) -> Dict[str, str]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_memo(path: Path, memo: Dict[str, str]) -> None:
    try:
        _write_json(path, memo)
    except OSError:
        pass  # a read-only cache root only costs re-hashing next time


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# Building


def _build(cfg: TrainConfig, tokenizer: Any, key: str, root: Path, final: Path, quarantine: Path) -> None:
    """Prepare into a temporary directory and rename it to `final`; bad rows are listed in `quarantine` (the run
    directory's copy, kept when preparation fails) and copied into the cache for later cache hits."""
    started = time.time()
    tmp = root / f".tmp-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, quarantine)
    try:
        convs = list(iter_conversations(cfg.dataset, report=report))
        encoded = encode_all(convs, tokenizer, cfg)
        for i, (reason, detail) in encoded.bad:
            conv = convs[i]
            report.add(conv.path, conv.loc, BadRow(reason, detail), conversation_dict(conv))
        report.check()
        if not len(encoded.kept):
            raise DataError(f"dataset {cfg.dataset.name}: no usable samples ({report.summary()})")
        val_pick = split_val(len(encoded.kept), cfg.dataset.val_size, cfg.trainer.seed)
        val_items = [(int(encoded.kept[j]), 0) for j in val_pick]
        in_val = set(val_pick)
        train_members = [int(encoded.kept[j]) for j in range(len(encoded.kept)) if j not in in_val]
        weights = {src.name: src.weight for src in resolve_sources(cfg.dataset)}
        train_items = mix(train_members, [c.source for c in convs], weights, cfg.trainer.seed)
        stats = _stats(cfg, convs, report, encoded, train_items, val_items)
        for split, items in (("train", train_items), ("val", val_items)):
            if items:
                rows, eff = write_split(tmp / split, items, convs, encoded, cfg)
                stats["rows"][split], stats["packing_efficiency"][split] = rows, eff
        stats["seconds"] = round(time.time() - started, 2)
        stats["cache_key"] = key
        _write_json(tmp / STATS_FILE, stats)
        if quarantine.is_file():
            shutil.copyfile(quarantine, tmp / QUARANTINE_FILE)
        (tmp / "done").write_text(key, encoding="utf-8")
        try:
            os.rename(tmp, final)
        except OSError:  # another run finished the same key first; theirs is identical
            if not (final / "done").is_file():
                raise
    finally:
        report.close()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class Encoded:
    """All conversations tokenized: sample i's tokens are flat[starts[i]:starts[i]+lengths[i]] (length 0: none)."""

    input_ids: np.ndarray
    labels: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    kept: np.ndarray  # indices of conversations with an Example
    dropped: List[int]  # nothing trained left after truncation
    bad: List[Tuple[int, Tuple[Any, str]]]  # (conversation index, (BadReason, detail)) from the template


_worker_encoder: Optional[Encoder] = None


def _init_worker(tokenizer: Any, cfg: TrainConfig) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_encoder = Encoder(tokenizer, cfg)


def _encode_chunk(args: Tuple[int, List[Conversation]]):
    start, convs = args
    assert _worker_encoder is not None
    errors: List[Tuple[Conversation, BadRow]] = []
    examples = _worker_encoder.encode_batch(convs, errors)
    bad_ids = {id(c): b for c, b in errors}
    lengths = np.zeros(len(convs), dtype=np.int64)
    truncated = np.zeros(len(convs), dtype=bool)
    ids: List[int] = []
    labels: List[int] = []
    bad, dropped = [], []
    for k, (conv, ex) in enumerate(zip(convs, examples)):
        if ex is None:
            b = bad_ids.get(id(conv))
            if b is not None:
                bad.append((start + k, (b.reason, b.detail)))
            else:
                dropped.append(start + k)
            continue
        lengths[k] = len(ex.input_ids)
        truncated[k] = ex.truncated
        ids += ex.input_ids
        labels += ex.labels
    return np.asarray(ids, np.int32), np.asarray(labels, np.int32), lengths, truncated, bad, dropped


def encode_all(convs: Sequence[Conversation], tokenizer: Any, cfg: TrainConfig) -> Encoded:
    tasks = [(s, list(convs[s: s + CHUNK])) for s in range(0, len(convs), CHUNK)]
    workers = min(cfg.data.preprocess_workers, len(tasks))
    if workers <= 1:
        _init_worker_local(tokenizer, cfg)
        results = [_encode_chunk(t) for t in tasks]
    else:
        with get_context().Pool(workers, initializer=_init_worker, initargs=(tokenizer, cfg)) as pool:
            results = list(pool.imap(_encode_chunk, tasks))
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
    lengths = cat([r[2] for r in results], np.int64)
    return Encoded(
        input_ids=cat([r[0] for r in results], np.int32),
        labels=cat([r[1] for r in results], np.int32),
        starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths,
        lengths=lengths,
        truncated=cat([r[3] for r in results], bool),
        kept=np.flatnonzero(lengths > 0),
        dropped=[i for r in results for i in r[5]],
        bad=[b for r in results for b in r[4]],
    )


def _init_worker_local(tokenizer: Any, cfg: TrainConfig) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(tokenizer, cfg)


def split_val(n: int, val_size: float, seed: int) -> List[int]:
    """Positions (sorted) of the validation samples among n kept samples."""
    if val_size <= 0:
        return []
    k = int(val_size) if val_size >= 1 else max(1, round(n * val_size))
    if k >= n:
        raise DataError(f"dataset.val_size: {k} validation samples leave nothing to train on ({n} usable samples)")
    return sorted(random.Random(seed).sample(range(n), k))


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


def write_split(path: Path, items: List[Tuple[int, int]], convs: Sequence[Conversation], enc: Encoded,
                cfg: TrainConfig) -> Tuple[int, Optional[float]]:
    """Save one split as an HF dataset; returns (rows, packing efficiency or None)."""
    import datasets
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    conv_idx = np.array([i for i, _ in items], dtype=np.int64)
    sample_ids = [convs[i].id if copy == 0 else f"{convs[i].id}@{copy}" for i, copy in items]
    lengths = enc.lengths[conv_idx]
    cutoff = cfg.data.cutoff_len
    if cfg.data.packing:
        rows = pack_plan(lengths.tolist(), cutoff)
        order = np.array([m for row in rows for m in row], dtype=np.int64)
        row_sizes = np.array([len(row) for row in rows], dtype=np.int64)  # samples per row
    else:
        order = np.arange(len(items), dtype=np.int64)
        row_sizes = np.ones(len(items), dtype=np.int64)
    lens = lengths[order]
    first = np.cumsum(lens) - lens  # where each sample starts in the output
    gather = np.repeat(enc.starts[conv_idx[order]] - first, lens) + np.arange(int(lens.sum()))
    input_ids, labels = enc.input_ids[gather], enc.labels[gather].copy()
    positions = (np.arange(int(lens.sum())) - np.repeat(first, lens)).astype(np.int32)
    if cfg.data.packing:
        labels[first[lens > 0]] = IGNORE_INDEX  # never predict across a sample boundary
    sample_bounds = np.concatenate([[0], np.cumsum(row_sizes)])
    token_bounds = np.concatenate([[0], np.cumsum(lens)])[sample_bounds]

    def lists(values: Any, bounds: np.ndarray) -> pa.Array:
        if bounds[-1] >= 2**31:  # more than 2^31 tokens in one split: 64-bit offsets
            return pa.LargeListArray.from_arrays(pa.array(bounds, pa.int64()), values)
        return pa.ListArray.from_arrays(pa.array(bounds, pa.int32()), values)

    ordered_ids = [sample_ids[i] for i in order]
    table = pa.table({
        "ids": lists(pa.array(ordered_ids, pa.string()), sample_bounds),
        "input_ids": lists(pa.array(input_ids, pa.int32()), token_bounds),
        "labels": lists(pa.array(labels, pa.int32()), token_bounds),
        "position_ids": lists(pa.array(positions, pa.int32()), token_bounds),
    })
    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one summary line at the end instead of a bar per split
    try:
        Dataset(InMemoryTable(table)).save_to_disk(str(path))
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    eff = packing_efficiency(int(lens.sum()), len(row_sizes), cutoff) if cfg.data.packing else None
    return len(row_sizes), eff


# ----------------------------------------------------------------------------------------------------------------
# Statistics


def _stats(cfg: TrainConfig, convs: Sequence[Conversation], report: BadRowReport, enc: Encoded,
           train_items: List[Tuple[int, int]], val_items: List[Tuple[int, int]]) -> Dict[str, Any]:
    kept_lengths = enc.lengths[enc.kept]
    trained = int((enc.labels != IGNORE_INDEX).sum())
    tokens = int(enc.lengths.sum())
    per_source: Dict[str, Dict[str, Any]] = {}
    weights = {src.name: src.weight for src in resolve_sources(cfg.dataset)}
    for c in convs:
        per_source.setdefault(c.source, {"conversations": 0, "weight": weights.get(c.source, 1.0), "train_samples": 0})
        per_source[c.source]["conversations"] += 1
    for i, _ in train_items:
        per_source[convs[i].source]["train_samples"] += 1
    id_counts = Counter(c.id for c in convs)
    return {
        "dataset": cfg.dataset.name,
        "template": cfg.template.name.value,
        "train_on": cfg.data.train_on.value,
        "cutoff_len": cfg.data.cutoff_len,
        "packing": cfg.data.packing,
        "rows_read": report.rows_read,
        "rows_kept": len(enc.kept),
        "skipped": dict(sorted(report.counts.items())),
        "skipped_total": report.skipped,
        "trailing_turns_dropped": report.trailing_turns_dropped,
        "truncated": int(enc.truncated.sum()),
        "truncated_share": float(enc.truncated.sum() / max(1, len(enc.kept))),
        "dropped_all_trained_cut": len(enc.dropped),
        "duplicate_ids": sum(n - 1 for n in id_counts.values() if n > 1),
        "samples": {"train": len(train_items), "val": len(val_items)},
        "rows": {"train": 0, "val": 0},
        "tokens": tokens,
        "trained_tokens": trained,
        "trained_token_share": trained / tokens if tokens else 0.0,
        "length": _length_stats(kept_lengths, cfg.data.cutoff_len),
        "packing_efficiency": {"train": None, "val": None},  # real tokens / row slots, when packing
        "sources": per_source,
    }


def _length_stats(lengths: np.ndarray, cutoff: int, bins: int = 8) -> Dict[str, Any]:
    if not len(lengths):
        return {"mean": 0, "max": 0, "histogram": []}
    edges = np.linspace(0, cutoff, bins + 1).astype(int)
    counts, _ = np.histogram(lengths, bins=edges)
    return {
        "mean": float(lengths.mean()),
        "p50": int(np.percentile(lengths, 50)),
        "p95": int(np.percentile(lengths, 95)),
        "max": int(lengths.max()),
        "histogram": [[int(a) + (i > 0), int(b), int(n)] for i, (a, b, n) in enumerate(zip(edges[:-1], edges[1:], counts))],
    }


def summary(stats: Dict[str, Any]) -> str:
    skipped = ", ".join(f"{k}={v}" for k, v in stats["skipped"].items()) or "none"
    lines = [
        f"data: {stats['rows_read']} rows read, {stats['rows_kept']} kept, skipped: {skipped}"
        + (f" (quarantine: {stats['quarantine']})" if stats.get("quarantine") else ""),
        f"data: {stats['samples']['train']} train / {stats['samples']['val']} val samples in "
        f"{stats['rows']['train']} / {stats['rows']['val']} rows; {stats['truncated']} truncated, "
        f"{stats['dropped_all_trained_cut']} dropped (nothing trained left), "
        f"{stats['trailing_turns_dropped']} lost trailing non-assistant turns; trained tokens "
        f"{stats['trained_token_share']:.1%}",
    ]
    eff = stats["packing_efficiency"]["train"]
    if eff is not None:
        lines.append(f"data: packing efficiency {eff:.1%} (train)")
    lines.append(f"data: cache {'hit' if stats.get('cache_hit') else 'written'}: {stats.get('cache_dir')}")
    return "\n".join(lines)
