"""Red team: the dataset registry read within bounds, checked where it is used; sample ids that are no positions."""

from __future__ import annotations

import pytest

from dsrecipes.core.errors import ConfigError
from dsrecipes.data.sources.registry import load_registry

# --- 1. a registry file is read within bounds ------------------------------------------------------------------


def test_a_registry_larger_than_its_bound_is_refused_unread(tmp_path):
    """Was: `json.load(fh)` / `fh.read()` read the whole file, however large: a 300 MB YAML registry of comments
    kept `dsrecipes inspect-data dataset.registry=big.yaml dataset.use=[x]` parsing past a 120 s timeout (670 MB
    resident), a 2 GB one exhausted memory. Now at most MAX_REGISTRY_BYTES are read: one message naming the file."""
    (tmp_path / "rows.jsonl").write_text('{"conversations": []}\n', encoding="utf-8")
    registry = tmp_path / "dataset_info.json"
    with open(registry, "w", encoding="utf-8") as fh:  # valid JSON: only its size is wrong
        fh.write('{"x": {"file_name": "rows.jsonl"}}')
        fh.write(" " * (17 << 20))  # LLaMA-Factory's own dataset_info.json is about 30 KB
    with pytest.raises(ConfigError, match=rf"dataset.registry: cannot read {registry}: larger than \d+ bytes"):
        load_registry(str(registry), ["x"])
    from dsrecipes.data.sources.registry import MAX_REGISTRY_BYTES

    big = tmp_path / "reg.yaml"
    big.write_text("x:\n  paths: [rows.jsonl]\n" + "#" * (MAX_REGISTRY_BYTES["yaml"] + 1), encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"cannot read {big}: larger than"):
        load_registry(str(big), ["x"])
