"""Caches carry content hashes checked on use (issue 50 item 3), hostile cases:

- a prepared-data cache whose Arrow file had one byte changed after it was published (same size, same mtime) is
  refused, naming the file, by the launching process and by a rank opening it (a change after the launching
  process's check); before the content record, the changed tokens were trained on silently;
- the DPO reference cache is keyed by the content of the model's files: weights swapped for other weights of the
  same size with the modification time set back get their own reference log-probs (the size+mtime key reused the
  old ones silently);
- a reference cache changed after it was published is refused, naming the file;
- a cache directory with no content record is refused (it was not published by this code).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.data.prepare.cache_contents import CONTENTS


def poke(path: Path) -> None:
    """Change one byte in the middle of `path`, keeping its size and modification time."""
    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(st.st_size // 2)
        byte = fh.read(1)
        fh.seek(st.st_size // 2)
        fh.write(bytes([byte[0] ^ 0x55]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def arrow_file(split_dir: Path) -> Path:
    (path,) = sorted(split_dir.glob("*.arrow"))[:1]
    return path


def test_a_poisoned_prepared_cache_is_refused_naming_the_file(make_cfg, tmp_path):
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import load_prepared, prepare

    cfg = make_cfg("dataset.max_samples=40", "dataset.val_size=4", f"data.cache_dir={tmp_path / 'cache'}")
    tok = load_tokenizer(cfg)
    first = prepare(cfg, tok, tmp_path / "run1")
    assert (first.cache_dir / CONTENTS).is_file()
    target = arrow_file(first.cache_dir / "train")
    poke(target)
    with pytest.raises(DataError, match=rf"{target}: changed after the cache was published.*delete "
                                        rf"{first.cache_dir}"):
        prepare(cfg, tok, tmp_path / "run2")
    poke(target)  # back as published: a cache hit again, and a rank opens it
    prepare(cfg, tok, tmp_path / "run3")
    load_prepared(cfg, tmp_path / "run3")
    poke(target)  # changed between the launching process's check and the rank's
    with pytest.raises(DataError, match=rf"{target}: changed after the cache was published"):
        load_prepared(cfg, tmp_path / "run3")
    poke(target)
    extra = first.cache_dir / "train" / "data-99999-of-99999.arrow"
    extra.write_bytes(b"x")
    with pytest.raises(DataError, match=rf"{extra}: is not in the record"):
        prepare(cfg, tok, tmp_path / "run4")
    extra.unlink()
    (first.cache_dir / CONTENTS).unlink()
    with pytest.raises(DataError, match=rf"{first.cache_dir / CONTENTS}: no readable content record"):
        prepare(cfg, tok, tmp_path / "run5")


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny models (different seeds) saved with the tokenizer: their weight files have the same size."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.modeling.model import build_model

    root = tmp_path_factory.mktemp("models")
    out = []
    for seed in (0, 7):
        cfg = compose_and_load([f"model.tiny.seed={seed}"], check_files=False)
        tok = load_tokenizer(cfg)
        path = root / f"seed{seed}"
        build_model(cfg, tok).save_pretrained(path)
        tok.save_pretrained(path)
        out.append(path)
    a, b = (p / "model.safetensors" for p in out)
    assert a.stat().st_size == b.stat().st_size
    return out


def dpo_cfg(model: Path, cache: Path):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(["objective=dpo", "dataset=sample_pairs", "dataset.max_samples=12", "dataset.val_size=2",
                             "data.cutoff_len=256", "trainer.micro_batch_size=4", f"model.path={model}",
                             f"data.cache_dir={cache}"])


def ref_logps(prepared):
    return list(prepared.train.table.column("ref_chosen_logps").to_pylist())


def test_reference_cache_follows_the_weights_content_not_their_mtime(two_models, tmp_path):
    import shutil

    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    model = tmp_path / "model"
    shutil.copytree(two_models[0], model)
    cfg = dpo_cfg(model, tmp_path / "cache")
    tok = load_tokenizer(cfg)
    first = prepare(cfg, tok, tmp_path / "run1")
    weights = model / "model.safetensors"
    st = os.stat(weights)
    shutil.copyfile(two_models[1] / "model.safetensors", weights)  # other weights, same size
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... and the old modification time
    second = prepare(cfg, tok, tmp_path / "run2")
    assert second.stats["reference_dir"] != first.stats["reference_dir"]
    assert ref_logps(second) != pytest.approx(ref_logps(first))


def test_a_changed_reference_cache_is_refused_naming_the_file(two_models, tmp_path):
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    cfg = dpo_cfg(two_models[0], tmp_path / "cache")
    tok = load_tokenizer(cfg)
    first = prepare(cfg, tok, tmp_path / "run1")
    ref = Path(first.stats["reference_dir"])
    assert (ref / CONTENTS).is_file()
    target = arrow_file(ref / "train")
    poke(target)
    with pytest.raises(DataError, match=rf"{target}: changed after the cache was published"):
        prepare(cfg, tok, tmp_path / "run2")
