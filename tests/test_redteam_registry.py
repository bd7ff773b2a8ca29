"""Red team: the dataset registry read within bounds, checked where it is used; sample ids that are no positions."""

from __future__ import annotations

import json

import pytest

from dsrecipes.core.errors import ConfigError
from dsrecipes.data.sources.files import read_rows
from dsrecipes.data.sources.registry import load_registry
from tests.test_redteam_trust2 import URL, counted_store  # noqa: F401 (a fixture)

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


# --- 2. the registry used is the registry checked --------------------------------------------------------------


def test_a_registry_swapped_after_its_check_is_not_used(counted_store, tmp_path, monkeypatch, capsys):  # noqa: F811
    """Was: config/safety.py read a shared recipe's registry when the config was composed (its entries' buckets: a
    shared recipe's may not be signed for), and the data was read from a second read of the file: a registry
    rewritten in between (by whoever shares its folder) sent requests signed with the user's credentials to the
    recipe author's bucket: `validate` listed s3://their-bucket. Now every later read must find the checked bytes."""
    from dsrecipes.config import safety
    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)
    rows = [json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) for i in range(30)]
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    registry = tmp_path / "registry.yaml"
    registry.write_text("ours:\n  paths: [rows.jsonl]\n  format: alpaca\n", encoding="utf-8")
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f"dataset:\n  use: [ours]\n  registry: {registry}\n", encoding="utf-8")
    checked = safety.registry_buckets

    def then_swapped(given, use):  # the check passes, then the file changes
        found = checked(given, use)
        registry.write_text(f"ours:\n  paths: [{URL}]\n  format: alpaca\n", encoding="utf-8")
        return found

    monkeypatch.setattr(safety, "registry_buckets", then_swapped)
    refused(capsys, ["validate", f"recipe={recipe}"], f"dataset.registry: {registry} changed after this command "
            "checked it")
    assert counted_store == []


# --- 3. sample ids are no positions ----------------------------------------------------------------------------


def test_grpo_seeds_two_prompts_with_the_same_sample_id_differently(tmp_path):
    """Was: completion seeds were drawn from the sample id, and a row without an `id` is `basename:line`: line 1 of
    a/train.jsonl and of b/train.jsonl (two prompts) got the same seeds, so their completions were sampled from the
    same random stream. Now from the position the loader dealt (`keys`: the ledger's, unique in an epoch)."""
    from dsrecipes.objectives.grpo import GRPO

    ids = []
    for d, prompt in (("a", "2+2?"), ("b", "3+3?")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "train.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n", encoding="utf-8")
        ids += [row.default_id for row in read_rows(str(tmp_path / d / "train.jsonl"))]
    assert ids[0] == ids[1] == "train.jsonl:1"  # the collision, as the reader names rows
    grpo = GRPO(pad_id=0, num_generations=2, max_completion_length=4, temperature=1.0, epsilon=0.2, beta=0.0,
                seed=7, parts=("exact",))
    batch = grpo.collate([{"ids": [i], "prompt_ids": [5, 6], "reference": "4"} for i in ids])
    batch["keys"] = ["row0", "row1"]  # what the map loader sets (data/strategies/map.py)
    seen = []

    class Sampled(Exception):
        pass

    def generate(model, prompts, mask, seeds):
        seen.extend(seeds)
        raise Sampled

    grpo.generate = generate
    with pytest.raises(Sampled):
        grpo.rollout(None, batch, "cpu", 0, train=True)
    assert len(seen) == 4 and len(set(seen)) == 4, seen
