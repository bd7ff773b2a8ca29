"""`dataset.val_paths` under an objective on pairs: the given validation file is the one evaluated, for every data
strategy (map, iterable, presharded).

Before conversations and pairs shared one split (data/sources/splits.py `split_and_mix`), `objective=dpo data=map`
silently ignored `dataset.val_paths` (data/prepare/pairs.py only split by `dataset.val_size`): a real SmolLM2 run
evaluated on pairs held out of the training file and never read the given one. Each test builds the launching
process's part and the loaders of 2 simulated ranks (tests/test_dpo_strategies.py) and compares the evaluated pair ids
with the ids of the validation file's pairs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dsrecipes.core.paths import SAMPLE_DATA_DIR

PAIRS = ["objective=dpo", "objective.reference=live", "dataset=sample_pairs", "data.cutoff_len=256",
         "trainer.micro_batch_size=2", "trainer.grad_accum=2"]
TRAIN = 40  # dataset.max_samples: the first pairs of the bundled file train
HELD = 10  # the last pairs of the bundled file, copied into the validation file


def compose(*overrides: str):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load([*PAIRS, *overrides])


@pytest.fixture(scope="module")
def tok():
    from dsrecipes.core.tokenizer import load_tokenizer

    return load_tokenizer(compose())


@pytest.fixture(scope="module")
def val_file(tmp_path_factory) -> Path:
    lines = (SAMPLE_DATA_DIR / "pairs.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) > TRAIN + HELD
    path = tmp_path_factory.mktemp("val") / "held_pairs.jsonl"
    path.write_text("\n".join(lines[-HELD:]) + "\n", encoding="utf-8")
    return path


def val_ids(path: Path):
    """The ids of the validation file's pairs, as the sources give them (read the way val_paths are read)."""
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.data.render.preference_encode import iter_pairs
    from dsrecipes.data.sources.badrows import BadRowReport

    report = BadRowReport("error", 1.0)
    ids = [p.prompt.id for p in iter_pairs(SourceConfig(name="v", paths=[str(path)]), report, None, 1 << 20)]
    assert len(ids) == HELD
    return ids


def evaluated(cfg, run_dir: Path, tok):
    """(evaluated pair ids over both ranks, trained pair ids of epoch 0)."""
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    plan = plan_like_launcher(cfg, run_dir, 2)
    built = [build_loaders(cfg, tok, r, 2, run_dir, plan) for r in range(2)]
    held = [i for _, ev in built if ev is not None for b in ev for i in b["ids"]]
    trained = []
    for lo, _ in built:
        lo.set_epoch(0)
        trained += [i for b in lo for i in b["ids"]]
    return held, trained


def check(held, trained, want):
    assert sorted(held) == sorted(want), "the evaluated pairs are not the validation file's"
    assert not set(trained) & set(want)


def test_map_evaluates_the_val_file(val_file, tok, tmp_path):
    cfg = compose("data=map", f"dataset.max_samples={TRAIN}", "dataset.val_size=4", f"dataset.val_paths=[{val_file}]",
                  f"data.cache_dir={tmp_path}/c")
    held, trained = evaluated(cfg, tmp_path / "run", tok)
    check(held, trained, val_ids(val_file))
    assert len(set(trained)) == TRAIN  # nothing of the training file was held out instead


def test_iterable_evaluates_the_val_file(val_file, tok, tmp_path):
    cfg = compose("data=iterable", f"dataset.max_samples={TRAIN}", f"dataset.val_paths=[{val_file}]",
                  f"data.cache_dir={tmp_path}/c")
    held, trained = evaluated(cfg, tmp_path / "run", tok)
    check(held, trained, val_ids(val_file))


def test_presharded_evaluates_the_val_file(val_file, tok, tmp_path):
    from dsrecipes.data.shard.build import shard

    out = tmp_path / "pairs"
    shard(compose(f"dataset.max_samples={TRAIN}", f"data.cache_dir={tmp_path}/c"), 2, str(out), val_size=4)
    cfg = compose("data=presharded", f"data.shard_dir={out}", f"dataset.val_paths=[{val_file}]",
                  f"data.cache_dir={tmp_path}/c")
    held, trained = evaluated(cfg, tmp_path / "run", tok)
    check(held, trained, val_ids(val_file))
