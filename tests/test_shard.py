"""`dsrecipes shard` and data=presharded on the bundled sample data and the bundled glaive tool-call files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.cli import main as cli_main
from dsrecipes.core.errors import DataError
from dsrecipes.core.paths import SAMPLE_DATA_DIR
from dsrecipes.data.shard.build import MANIFEST, assign_balanced, read_manifest

SAMPLE = str(SAMPLE_DATA_DIR / "train.jsonl")


def shard_cli(*args: str) -> int:
    return cli_main(["shard", *args])


def part_ids(out: Path, manifest):
    ids = []
    for f in manifest.files:
        with open(out / f, encoding="utf-8") as fh:
            ids.append([json.loads(line)["id"] for line in fh])
    return ids


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "s3"
    assert shard_cli(SAMPLE, "--parts", "3", "--out", str(out), "dataset.max_samples=100") == 0
    return out


def test_shard_samples_balance(sharded, capsys):
    m = read_manifest(str(sharded), world_size=3)
    assert m.parts == 3 and m.balance == "samples"
    assert max(m.counts) - min(m.counts) <= 1 and m.total == 100
    assert [f for f in m.files] == ["part_00.jsonl", "part_01.jsonl", "part_02.jsonl"]
    ids = part_ids(sharded, m)
    flat = [i for p in ids for i in p]
    assert len(flat) == len(set(flat)) == 100
    assert [len(p) for p in ids] == m.counts
    assert m.sources and m.sources[0]["path"].endswith("train.jsonl") and len(m.sources[0]["sha256"]) == 64


def test_parts_keep_ids_and_conversations(sharded):
    """Canonical rows read back (default ShareGPT columns) to the same conversations as the source rows."""
    from dsrecipes.core.schema import BadRows, SourceConfig
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.sharegpt import iter_source

    m = read_manifest(str(sharded))
    report = BadRowReport(BadRows.error, 0.0)
    original = {c.id: c for c in iter_source(SourceConfig(name="s", paths=[SAMPLE]), report, limit=100)}
    for f in m.files:
        for conv in iter_source(SourceConfig(name="p", paths=[str(sharded / f)]), report):
            o = original[conv.id]
            assert (conv.turns, conv.system, conv.tools) == (o.turns, o.system, o.tools)


def test_part_count_must_equal_world_size(sharded):
    with pytest.raises(DataError) as exc:
        read_manifest(str(sharded), world_size=4)
    msg = str(exc.value)
    assert "holds 3 parts but the run has 4 ranks" in msg and "--parts 4" in msg and "dsrecipes shard" in msg


def test_existing_output_needs_force(sharded, capsys):
    assert shard_cli(SAMPLE, "--parts", "3", "--out", str(sharded)) == 2
    assert "--force" in capsys.readouterr().err


def test_shard_tokens_balance(tmp_path):
    out = tmp_path / "tok"
    assert shard_cli(SAMPLE, "--parts", "4", "--out", str(out), "--balance", "tokens", "dataset.max_samples=120") == 0
    m = read_manifest(str(out), world_size=4)
    assert m.balance == "tokens" and max(m.counts) - min(m.counts) <= 1
    assert m.tokens is not None and len(m.tokens) == 4
    assert max(m.tokens) - min(m.tokens) <= 0.1 * sum(m.tokens) / 4


def test_assign_balanced_counts_and_tokens():
    tokens = [100, 1, 1, 1, 1, 1, 1, 50, 50, 3]
    parts = assign_balanced(tokens, 3)
    counts = [parts.count(p) for p in range(3)]
    assert sorted(counts) == [3, 3, 4]
    loads = [sum(t for t, p in zip(tokens, parts) if p == q) for q in range(3)]
    assert max(loads) == 102  # the long sample only gets the two shortest ones (counts stay equal)


def test_presharded_loaders_read_only_their_part(sharded, tmp_path):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    cfg = compose_and_load(["debug=fast", "data=presharded", f"data.shard_dir={sharded}", "data.num_workers=2",
                            "trainer.micro_batch_size=4"])
    tok = load_tokenizer(cfg)
    m = read_manifest(str(sharded))
    ids = part_ids(sharded, m)
    plan = plan_like_launcher(cfg, tmp_path, 3)
    assert plan.rows == m.total and plan.steps_per_epoch == min(m.counts) // 4
    seen = []
    for rank in range(3):
        lo, ev = build_loaders(cfg, tok, rank, 3, tmp_path, plan)
        assert lo.steps_per_epoch == min(m.counts) // 4 and ev is None  # no validation part, no val_paths
        got = [i for b in lo for i in b["ids"]]
        assert len(got) == lo.steps_per_epoch * 4 and set(got) <= set(ids[rank])
        seen.append(got)
    with pytest.raises(DataError, match="holds 3 parts but the run has 2 ranks"):
        build_loaders(cfg, tok, 0, 2, tmp_path, plan)
    with pytest.raises(DataError, match="holds 3 parts but the run has 2 ranks"):  # refused before any rank starts
        plan_like_launcher(cfg, tmp_path / "two", 2)


def test_modified_part_is_refused(tmp_path):
    out = tmp_path / "s2"
    assert shard_cli(SAMPLE, "--parts", "2", "--out", str(out), "dataset.max_samples=10") == 0
    with open(out / "part_01.jsonl", "a") as fh:
        fh.write("\n")
    from dsrecipes.data.shard.build import verify_part

    verify_part(read_manifest(str(out)), 0)
    with pytest.raises(DataError, match="sha256"):
        verify_part(read_manifest(str(out)), 1)
    assert json.loads((out / MANIFEST).read_text())["total"] == 10


def test_shard_json_array_input(glaive, tmp_path):
    """A real JSON-array file with tool calls (glaive) becomes JSONL parts; ids are <file>:<index>."""
    out = tmp_path / "glaive"
    src = str(glaive / "glaive_toolcall_en_demo.json.gz")
    assert shard_cli(src, "--parts", "2", "--out", str(out)) == 0
    m = read_manifest(str(out), world_size=2)
    assert m.total == 300
    ids = part_ids(out, m)
    assert ids[0][0] == "glaive_toolcall_en_demo.json.gz:0"


def test_printed_training_command_keeps_training_overrides_only(tmp_path):
    """The full command works as printed (test_guarantees_e2e runs it); here: what it carries over."""
    from dsrecipes.commands.shard import training_command

    overrides = ["dataset.max_samples=10", "+dataset.extra=1", "data=iterable", "launcher=torchrun", "model=tiny",
                 "data.cutoff_len=64", "trainer.max_steps=3", "trainer.output_dir=/runs/a b"]  # fmt: skip
    assert training_command(str(tmp_path / "p"), 4, overrides) == (
        f"python -m dsrecipes data=presharded data.shard_dir={tmp_path / 'p'} launcher=deepspeed launcher.num_gpus=4 "
        "model=tiny data.cutoff_len=64 trainer.max_steps=3 'trainer.output_dir=/runs/a b'")
