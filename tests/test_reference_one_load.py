"""DPO's precomputed reference (objectives/dpo_reference.py): the launching process loads the reference model ONCE
for the train and the validation split. Was: once per split (precompute was called per split and built the model
each time): a second full load of the reference (a 135M model: ~30% of test_dpo_smollm2's preparation), against the
module's own docstring ('loads the reference model once')."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

import dsrecipes.objectives.dpo_reference as dpo_reference
from dsrecipes.core.tokenizer import load_tokenizer
from dsrecipes.data.prepare.build import prepare


def test_the_reference_model_is_loaded_once_for_both_splits(make_cfg, tmp_path, monkeypatch, capsys):
    loads = []
    real = dpo_reference.build_model
    monkeypatch.setattr(dpo_reference, "build_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    cfg = make_cfg("debug=fast", "objective=dpo", "dataset=sample_pairs", "dataset.max_samples=40", "dataset.val_size=8",
                   f"data.cache_dir={tmp_path}")
    prepared = prepare(cfg, load_tokenizer(cfg), tmp_path / "run")
    assert len(loads) == 1
    ref = prepared.stats["reference_dir"]
    for split, rows in (("train", 32), ("val", 8)):
        files = sorted((Path(ref) / split).glob("*.arrow"))
        table = pa.concat_tables(pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files)
        assert table.num_rows == rows and {"ref_chosen_logps", "ref_rejected_logps"} <= set(table.column_names)
    err = capsys.readouterr().err
    assert err.count("under the reference model") == 1 and "log-probs of 40 pairs" in err, err
