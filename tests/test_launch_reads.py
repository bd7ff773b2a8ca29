"""The launching side of a `data=iterable` run reads a local corpus once, cold (issue 43 item 7): a fresh start has
no checkpoint to compare its data identity against, so `decide` leaves it to the preparation, which hashes, indexes
and pre-scans in one pass; the plan records the same identity a separate hashing pass would have given."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.test_store import _corpus, _rchar


def _launch_side(make_cfg, data: Path, cache: Path, run: Path):
    """What `python -m dsrecipes` does before any rank starts: decide, then plan and write the run directory."""
    from dsrecipes.run.entry import decide, write_run_dir

    cfg = make_cfg("data=iterable", f"dataset.paths=[{data}/*.jsonl]", f"data.cache_dir={cache}",
                   "dataset.max_samples=null", "dataset.val_size=0", "trainer.max_steps=2",
                   f"trainer.output_dir={run}", check_files=False)
    run.mkdir(parents=True, exist_ok=True)
    decision = decide(cfg)
    return write_run_dir(cfg, decision.topology, decision)


@pytest.mark.slow
def test_a_fresh_stream_run_reads_its_local_corpus_once_and_records_the_same_identity(make_cfg, tmp_path):
    from dsrecipes.data.prepare.cache import data_files, data_fingerprint
    from dsrecipes.data.sources.registry import resolve_sources

    data = tmp_path / "data"
    data.mkdir()
    for k in range(2):
        (data / f"part{k}.jsonl").write_bytes(_corpus(200 if k == 0 else 100, pad=20000))  # ~6 MB
    corpus = sum(p.stat().st_size for p in data.iterdir())
    _launch_side(make_cfg, data, tmp_path / "warmup", tmp_path / "run0")  # imports, the tokenizer's files
    time.sleep(2.2)  # older than cache.RACY_SECONDS: a hash would be memoised, yet the first launch reads it once
    before = _rchar()
    plan = _launch_side(make_cfg, data, tmp_path / "cache", tmp_path / "run1")
    cold = _rchar() - before
    print(f"launching side, cold: read {cold / corpus:.3f}x the corpus ({corpus} B)")
    assert corpus <= cold < 1.05 * corpus + (1 << 20), (cold, corpus)  # hash in decide, then index: 2x
    cfg = make_cfg("data=iterable", f"dataset.paths=[{data}/*.jsonl]", f"data.cache_dir={tmp_path / 'other'}",
                   "dataset.max_samples=null", "dataset.val_size=0", "trainer.max_steps=2", check_files=False)
    sources = resolve_sources(cfg.dataset)
    assert plan.data_fingerprint == data_fingerprint(cfg, sources)  # what a resume compares against
    assert plan.data_files == data_files(cfg, sources) and len(plan.data_files) == 2
