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


def test_a_rank_reads_the_registry_the_launching_process_indexed(make_cfg, tmp_path, monkeypatch):
    """Was: an iterable run's ranks read dataset.registry again for the files' formats and columns (stream/index.py
    file_sources), whatever it held by then: a registry rewritten after the launching process indexed the stream was
    used unchecked (its entries' paths listed with the user's credentials, its columns read silently). Now the index
    records the sha256 of the registry it was built from, and a rank's read must find it."""
    from dsrecipes.data.sources import registry as reg
    from dsrecipes.data.stream.index import file_sources, index_stream, read_stream_index, write_stream_index

    rows = [json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) for i in range(30)]
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    registry = tmp_path / "registry.yaml"
    registry.write_text("ours:\n  paths: [rows.jsonl]\n  format: alpaca\n", encoding="utf-8")
    cfg = make_cfg("data=iterable", f"dataset.registry={registry}", "dataset.use=[ours]")
    write_stream_index(tmp_path, index_stream(cfg))
    monkeypatch.setattr(reg, "_DIGESTS", {})  # a rank: another process
    assert [s.name for s in file_sources(cfg, read_stream_index(tmp_path))] == ["ours"]
    registry.write_text("ours:\n  paths: [rows.jsonl]\n  format: alpaca\n  columns: {instruction: output, output: "
                        "instruction}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"dataset.registry: {registry} changed after the launching process read"):
        file_sources(cfg, read_stream_index(tmp_path))


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
