"""`prepare(cfg, tokenizer, run_dir)`: sources -> checked conversations -> split -> mix -> tokens -> cached Arrow.

Runs once, in the launching process, before any process group. Ranks call `load_prepared(cfg, run_dir)`, which
re-opens the cache named in `<run>/prepare_stats.json` (memory-mapped Arrow) without reading sources.

Order of operations (all deterministic for a config, data and `trainer.seed`):
1.+2. read every source (`dataset.paths`, `sources`, registry `use`) in order and tokenize it, in
   `data.preprocess_workers` processes (batch_encode.py); caps: `sources[i].max_samples` / registry `num_samples`
   (first N good rows of that source), `dataset.max_samples` (first N over all sources); bad rows per
   `dataset.bad_rows` (quarantine in `<run>/quarantine.jsonl`); samples whose trained tokens are all cut by
   `data.cutoff_len` are dropped and counted.
3. validation split: every sample of `dataset.val_paths` (read after the training sources, not capped by
   `dataset.max_samples`; a file that is also trained on is refused), else `dataset.val_size` of the kept samples:
   < 1 a fraction (rounded, at least 1), >= 1 a count, a seeded random choice (`trainer.seed`) kept in data order.
   Validation samples are never weighted or copied.
4. mixing weights on the training part, per source: `weight` w turns n samples into round(w * n): floor copies of
   every sample, plus a seeded choice of the remainder (w < 1 is a seeded subsample). Copy k >= 1 of a sample gets
   the id `<id>@<k>`, so every training row is unique. The weight scales a source, it is not a probability.
5. packing (`data.packing`) of each split, best-fit-decreasing; else one row per sample.

Cache: `<data.cache_dir or $XDG_CACHE_HOME/dsrecipes>/prepared/<key>`, key = hash of the input files' contents
(data/prepare/cache.py), the dataset/template config, cutoff_len, packing, train_on, seed and the
tokenizer itself (vocabulary, merges, special tokens, chat_template). The directory is staged beside and published
(core/publish.py, content-addressed: a run that finds the key already published keeps that one), so concurrent runs
never see half a cache. Its files' content hashes are recorded at publish (cache_contents.py `seal`) and checked
every time a run uses the cache (`check`): a changed file is refused, named, never trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.core.errors import DataError
from dsrecipes.core.fileio import atomic_write_json, dangling_link_problem, read_json_file
from dsrecipes.core.publish import Existing, publish_dir, staging_dir
from dsrecipes.core.schema import ReferenceMode, RowKind, SourceConfig, TrainConfig
from dsrecipes.data.prepare.arrow_split import write_split
from dsrecipes.data.prepare.cache import cache_key, cache_root
from dsrecipes.data.prepare.cache_contents import check, seal
from dsrecipes.data.prepare.pairs import (
    SampleRows,
    attach_reference,
    pair_columns,
    pair_stats,
    read_pairs,
    reference_key,
    write_rows,
)
from dsrecipes.data.prepare.prompts import prompt_columns, prompt_stats, read_prompts, reference_lines
from dsrecipes.data.prepare.stats import build_stats, summary
from dsrecipes.data.render.batch_encode import Encoded, read_and_encode
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.files import expand_paths, no_file
from dsrecipes.data.sources.preference import check_sources
from dsrecipes.data.sources.registry import resolve_sources, validation_files
from dsrecipes.data.sources.splits import split_and_mix
from dsrecipes.objectives.base import reference_mode

if TYPE_CHECKING:
    from dsrecipes.data.prepare.arrow_rows import ArrowRows

STATS_FILE = "prepare_stats.json"
REFERENCE_DIR = "reference"  # reference log-probs of prepared pairs, per reference model (content record of their own)
VAL_SOURCE = "dataset.val_paths"  # the source name of the validation files' samples
QUARANTINE_FILE = "quarantine.jsonl"


@dataclass
class Prepared:
    train: ArrowRows  # columns ids (list[str]), input_ids, labels, position_ids (list[int32])
    val: Optional[ArrowRows]  # None without validation samples (dataset.val_size 0, no dataset.val_paths)
    stats: Dict[str, Any]
    cache_dir: Path


def prepare(cfg: TrainConfig, tokenizer: Any, run_dir: str | Path) -> Prepared:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    notes: List[str] = []
    sources = resolve_sources(cfg.dataset, notes)  # once per preparation
    check_sources(cfg.objective.rows, sources)
    for note in notes:
        print(note, file=sys.stderr)
    val = val_sources(cfg, sources)
    key = cache_key(cfg, tokenizer, sources + val)
    root = cache_root(cfg) / "prepared"
    final = root / key
    hit = (final / "done").is_file()
    quarantine = run_dir / QUARANTINE_FILE
    quarantine.unlink(missing_ok=True)  # never leave an older run's list beside this run's data
    if hit:
        check(final, skip=[REFERENCE_DIR])
        if (final / QUARANTINE_FILE).is_file():
            shutil.copyfile(final / QUARANTINE_FILE, quarantine)
    else:
        _build(cfg, tokenizer, sources, val, key, root, final, quarantine)
    stats = read_stats(final / STATS_FILE)
    stats.update(cache_dir=str(final), cache_hit=hit)
    if precomputed_reference(cfg):
        stats["reference_dir"] = str(attach_reference(cfg, tokenizer, final))
    if quarantine.is_file():
        stats["quarantine"] = str(quarantine)
    lines = reference_lines(cfg, stats)  # prompt rows whose rewards have no reference to compare with (or refused)
    atomic_write_json(run_dir / STATS_FILE, stats)
    print("\n".join([summary(stats), *lines]), file=sys.stderr)
    return _open(final, stats)


def read_stats(path: Path) -> Dict[str, Any]:
    """A prepare_stats.json (a shared cache's, or the run directory's: prompt-eval reads another user's run), read
    within fileio's bounds; DataError naming it when it is no JSON object."""
    try:
        stats = read_json_file(path, "JSON nested too deeply")
        if not isinstance(stats, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not the preparation record dsrecipes writes ({exc}); prepare the data again") from None
    return stats


def load_prepared(cfg: TrainConfig, run_dir: str | Path) -> Prepared:
    """Re-open what `prepare` wrote for this run (on each rank); never reads the sources. The cache (and the reference
    log-probs) are checked against their content records here too, right before the rank maps them: a file changed
    after the launching process checked it is refused, not trained on."""
    path = Path(run_dir) / STATS_FILE
    if not path.is_file():
        raise DataError(f"{path}: missing; the launching process runs prepare() before starting ranks")
    stats = read_stats(path)
    cache = Path(stats["cache_dir"])
    if not (cache / "done").is_file():
        raise DataError(f"{cache}: prepared data is gone (cache cleared?); start the run again to re-prepare")
    for name, want in (("cutoff_len", cfg.data.cutoff_len), ("packing", cfg.data.packing)):
        if stats[name] != want:
            raise DataError(f"{path}: prepared with data.{name}={stats[name]}, but this config has {want}")
    if precomputed_reference(cfg):
        ref = Path(stats.get("reference_dir") or cache / REFERENCE_DIR / "none")
        if ref.name != reference_key(cfg) or not (ref / "done").is_file():
            raise DataError(f"{path}: no reference log-probs for this run's reference model (model.path changed "
                            "since preparation?); start the run again with `python -m dsrecipes`")
        check(ref)
    check(cache, skip=[REFERENCE_DIR])
    return _open(cache, stats)


def precomputed_reference(cfg: TrainConfig) -> bool:
    return reference_mode(cfg) is ReferenceMode.precomputed


def _open(cache: Path, stats: Dict[str, Any]) -> Prepared:
    """The prepared splits (with the reference log-probs of a precomputed DPO reference, when there are some), read
    with pyarrow alone (arrow_rows.py: no `datasets` import in a rank)."""
    from dsrecipes.data.prepare.arrow_rows import ArrowRows  # lazy: else `validate` and `show` import pyarrow (0.09 s)

    data = Path(stats.get("reference_dir") or cache)
    train = ArrowRows.open(data / "train")
    val = ArrowRows.open(data / "val") if (data / "val").is_dir() else None
    return Prepared(train, val, stats, cache)


def _build(cfg: TrainConfig, tokenizer: Any, sources: List[SourceConfig], val: List[SourceConfig], key: str,
           root: Path, final: Path, quarantine: Path) -> None:
    """Prepare into a staging directory, record its contents and publish it as `final`; bad rows are listed in
    `quarantine` (the run directory's copy, kept when preparation fails) and copied into the cache for later cache
    hits."""
    started = time.time()
    link = dangling_link_problem("data.cache_dir", root)  # mkdir would fail 'File exists' (or make the target)
    if link:
        raise DataError(link)
    try:  # a file, /proc, a read-only mount: one message naming the key (root's os.access says yes to all of them)
        root.mkdir(parents=True, exist_ok=True)
        tmp = staging_dir(final, "prep")
    except OSError as exc:
        raise DataError(f"data.cache_dir: cannot create {exc.filename or root} ({exc.strerror or exc}); set "
                        "data.cache_dir to a writable directory") from None
    report = BadRowReport(cfg.dataset.bad_rows, cfg.dataset.max_bad_fraction, quarantine)
    try:
        stats = build_split(PREPARATIONS[cfg.objective.rows], cfg, tokenizer, sources, val, report, key, tmp)
        stats["seconds"] = round(time.time() - started, 2)
        stats["cache_key"] = key
        atomic_write_json(tmp / STATS_FILE, stats)
        if quarantine.is_file():
            shutil.copyfile(quarantine, tmp / QUARANTINE_FILE)
        (tmp / "done").write_text(key, encoding="utf-8")
        seal(tmp)
        publish_dir(tmp, final, Existing.keep)  # another run finished the same key first: theirs is kept (checked)
    finally:
        report.close()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class Preparation:
    """How one row kind is prepared: read (then joined with the validation files' samples), counted, written. The
    data read has `sources` (each sample's source name, in read order) and `kept` (indices of its usable samples)."""

    what: str  # the samples, in the message when none is usable
    read: Callable[[TrainConfig, Any, Sequence[SourceConfig], BadRowReport], Any]
    join: Callable[[Any, Any], Any]
    stats: Callable[[TrainConfig, Sequence[SourceConfig], BadRowReport, Any, list, list], Dict[str, Any]]
    write: Callable[[Path, list, Any, TrainConfig, str], Tuple[int, Optional[float]]]  # -> rows, packing efficiency


PREPARATIONS: Dict[RowKind, Preparation] = {  # one per row kind (test_row_kinds.py)
    RowKind.conversation: Preparation("samples", read_and_encode, lambda a, b: join_encoded(a, b), build_stats,
                                      write_split),
    RowKind.pair: Preparation("preference pairs", read_pairs, SampleRows.join, pair_stats,
                              functools.partial(write_rows, pair_columns)),
    RowKind.prompt: Preparation("prompts", read_prompts, SampleRows.join, prompt_stats,
                                functools.partial(write_rows, prompt_columns)),
}


def build_split(prep: Preparation, cfg: TrainConfig, tokenizer: Any, sources: List[SourceConfig],
                val: List[SourceConfig], report: BadRowReport, key: str, tmp: Path) -> Dict[str, Any]:
    """Read the sources (then every sample of `val`, `dataset.val_paths`, not capped by `dataset.max_samples`),
    split and mix (splits.split_and_mix), write `tmp/train` (and `tmp/val`); returns the preparation's stats."""
    data = prep.read(cfg, tokenizer, sources, report)
    trained = len(data.sources)  # samples before this come from training sources
    if val:
        uncapped = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, max_samples=None))
        data = prep.join(data, prep.read(uncapped, tokenizer, val, report))
    report.check()
    kept = data.kept
    if not (kept < trained).any():
        raise DataError(f"dataset {cfg.dataset.name}: no usable {prep.what} ({report.summary()})")
    train_items, val_items = split_and_mix(kept[kept < trained], kept[kept >= trained], data.sources,
                                           {src.name: src.weight for src in sources}, cfg.dataset.val_size,
                                           cfg.trainer.seed)
    if not len(train_items):  # else a cache with no train split is published, and every later run hits it
        weights = ", ".join(f"{src.name} {src.weight:g}" for src in sources)
        raise DataError(f"dataset {cfg.dataset.name}: the mixing weights leave no training {prep.what} (weight "
                        f"{weights}: round(weight * samples) is 0 for each source); raise a source's weight")
    stats = prep.stats(cfg, sources, report, data, train_items, val_items)
    for split, items in (("train", train_items), ("val", val_items)):
        if items:
            stats["rows"][split], stats["packing_efficiency"][split] = prep.write(tmp / split, items, data, cfg,
                                                                                  f"{key}-{split}")
    return stats


def val_sources(cfg: TrainConfig, sources: List[SourceConfig]) -> List[SourceConfig]:
    """`dataset.val_paths` as one source (every row a validation sample; `dataset.val_size` is then unused), or
    none. A validation file that is also a training file is refused (registry.validation_files)."""
    if not cfg.dataset.val_paths:
        return []
    train = [f for src in sources for f in expand_paths(src.paths)[0]]
    files, missing = expand_paths(list(cfg.dataset.val_paths))
    if missing:
        raise DataError(f"dataset.val_paths: {no_file(missing[0])}")
    notes: List[str] = []
    files = validation_files(train, files, notes)
    for note in notes:
        print(note, file=sys.stderr)
    return [SourceConfig(name=VAL_SOURCE, paths=[glob.escape(f) for f in files])]


def preparation_key(cfg: TrainConfig, tokenizer: Any, sources: List[SourceConfig]) -> str:
    """The cache key of a preparation: the training sources and the validation files (their contents too)."""
    return cache_key(cfg, tokenizer, [*sources, *val_sources(cfg, sources)])


def join_encoded(a: Encoded, b: Encoded) -> Encoded:
    """The conversations of `a`, then those of `b` (one preparation read in two parts)."""
    n, tokens = len(a.ids), len(a.input_ids)
    cat = np.concatenate
    return Encoded(cat([a.input_ids, b.input_ids]), cat([a.labels, b.labels]), cat([a.starts, b.starts + tokens]),
                   cat([a.lengths, b.lengths]), cat([a.truncated, b.truncated]), cat([a.kept, b.kept + n]),
                   a.dropped + [d + n for d in b.dropped], a.ids + b.ids, a.sources + b.sources,
                   a.one_text and b.one_text, a.per_segment + b.per_segment, a.history_cut + b.history_cut)
