"""SFT on preference pairs as DeepSpeed-Chat's step 1 does: `dataset.pairs_as=chosen` reads a pair row as its prompt
turns + the chosen answer (trained under data.train_on like any assistant turn), in every format the preference
reader takes; the default (`refuse`) keeps a pair a bad row for SFT and names the key as the remedy.

Hostile: each format renders to exactly the tokens and labels of the conversation row it stands for; a pairs file
split {sft:2, reward:4, rl:4} gives SFT exactly the rows no other share reads (the split audit, and the real readers
of each stage); data=map and data=iterable deal the same samples; a bad value and a pairs_as under DPO are one
message, exit 2; a short real run of SFT on the pairs file, on each data strategy (presharded through
`dsrecipes shard`); the cache key changes with the key, so no preparation of the other mode is reused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.conftest import REPO, in_process_environ
from tests.test_walk4 import _error_line_of_many

PAIRS = REPO / "dsrecipes" / "assets" / "sample_data" / "pairs.jsonl"
SPLIT = ["++dataset.split.shares={sft:2,reward:4,rl:4}"]
OPENAI = {"messages": "messages", "role": "role", "content": "content"}
HISTORY = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello! How can I help?"},
           {"from": "human", "value": "Say something kind."}]
KIND, UNKIND = "You are doing great.", "No."


def _msgs(*turns):
    return [{"role": role, "content": content} for role, content in turns]


# (format, the pair row, the conversation row it stands for): LLaMA-Factory sharegpt pairs (multi-turn prompt, system
# and tools), TRL conversational (a system message opening the prompt), TRL standard text, TRL's implicit prompt
CASES = {
    "sharegpt": ("sharegpt",
                 {"conversations": HISTORY, "chosen": {"from": "gpt", "value": KIND},
                  "rejected": [{"from": "gpt", "value": UNKIND}], "system": "Be brief.", "tools": "[{\"name\": \"x\"}]"},
                 {"conversations": HISTORY + [{"from": "gpt", "value": KIND}], "system": "Be brief.",
                  "tools": "[{\"name\": \"x\"}]"}),
    "trl_conversational": ("openai",
                           {"prompt": _msgs(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"),
                                            ("user", "Say something kind.")),
                            "chosen": _msgs(("assistant", KIND)), "rejected": _msgs(("assistant", UNKIND))},
                           {"messages": _msgs(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"),
                                              ("user", "Say something kind."), ("assistant", KIND))}),
    "trl_standard_text": ("openai", {"prompt": "Say something kind.", "chosen": KIND, "rejected": UNKIND},
                          {"messages": _msgs(("user", "Say something kind."), ("assistant", KIND))}),
    "trl_implicit_prompt": ("openai",
                            {"chosen": _msgs(("user", "Hi"), ("assistant", "Hello!"), ("user", "Be kind."),
                                             ("assistant", KIND)),
                             "rejected": _msgs(("user", "Hi"), ("assistant", "Hello!"), ("user", "Be kind."),
                                               ("assistant", UNKIND))},
                            {"messages": _msgs(("user", "Hi"), ("assistant", "Hello!"), ("user", "Be kind."),
                                               ("assistant", KIND))}),
}


@pytest.fixture(scope="module")
def tok():
    from dsrecipes.core.tokenizer import load_tokenizer

    return load_tokenizer(_cfg())


def _cfg(*more: str):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load(["dataset.val_size=0", *more])


def _source(fmt: str, pairs_as: str = "refuse"):
    from dsrecipes.core.schema import ColumnsConfig, DatasetFormat, PairsAs, SourceConfig

    columns = ColumnsConfig(**OPENAI) if fmt == "openai" else ColumnsConfig()
    return SourceConfig(name="s", format=DatasetFormat(fmt), columns=columns, pairs_as=PairsAs(pairs_as))


@pytest.mark.parametrize("train_on", ["assistant", "all", "last_assistant"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_format_renders_as_the_conversation_of_its_prompt_and_chosen_answer(tok, case, train_on):
    from dsrecipes.data.render.labels import IGNORE_INDEX
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.sharegpt import normalize_row

    fmt, pair, conversation = CASES[case]
    encoder = Encoder(tok, _cfg(f"data.train_on={train_on}", "template=chatml"))
    got = encoder.encode(normalize_row(pair, "r", _source(fmt, "chosen")))
    want = encoder.encode(normalize_row(conversation, "r", _source(fmt)))
    assert got.input_ids == want.input_ids and got.labels == want.labels
    trained = tok.decode([t for t, label in zip(got.input_ids, got.labels) if label != IGNORE_INDEX])
    assert KIND in trained and UNKIND not in tok.decode(got.input_ids)
    assert ("Hello" in trained) is (train_on != "last_assistant" and case != "trl_standard_text")


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_default_refuses_a_pair_naming_the_key(case):
    from dsrecipes.data.sources.badrows import BadReason, BadRow
    from dsrecipes.data.sources.sharegpt import normalize_row

    fmt, pair, _ = CASES[case]
    with pytest.raises(BadRow) as bad:
        normalize_row(pair, "r", _source(fmt))
    assert bad.value.reason in (BadReason.preference_row, BadReason.no_assistant_turn, BadReason.missing_conversation)
    assert "dataset.pairs_as=chosen" in bad.value.advice


def test_a_broken_pair_is_the_bad_row_the_preference_reader_names():
    """Under pairs_as=chosen a pair is checked as a pair: no chosen answer is `missing_side`, not a conversation."""
    from dsrecipes.data.sources.badrows import BadReason, BadRow
    from dsrecipes.data.sources.sharegpt import normalize_row

    for row, reason in (({"conversations": HISTORY, "rejected": {"from": "gpt", "value": UNKIND}}, "missing_side"),
                        ({"conversations": HISTORY, "chosen": {"from": "gpt", "value": ""},
                          "rejected": {"from": "gpt", "value": UNKIND}}, "empty_answer")):
        with pytest.raises(BadRow) as bad:
            normalize_row(row, "r", _source("sharegpt", "chosen"))
        assert bad.value.reason is BadReason(reason)
    plain = {"conversations": HISTORY[:2]}  # a conversation row in the same file trains as it always did
    assert normalize_row(plain, "r", _source("sharegpt", "chosen")).turns[-1].content == "Hello! How can I help?"


def _ids_of(lines):
    from dsrecipes.data.sources.split_shares import row_id

    return {row_id(json.loads(line)): json.loads(line)["id"] for line in lines}


def test_the_sft_share_is_exactly_the_rows_no_other_stage_reads(tmp_path):
    """The split audit proves the shares disjoint and covering; the SFT reader (pairs as chosen) reads exactly the
    audit's `sft` rows, the reward and dpo readers (pairs) exactly theirs: the row id is the raw row's, whoever reads."""
    from dsrecipes.core.choices import BadRows
    from dsrecipes.data.render.preference_encode import iter_pairs
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.registry import resolve_sources
    from dsrecipes.data.sources.sharegpt import iter_conversations
    from dsrecipes.data.strategies.split_audit import audit_split

    cache = f"data.cache_dir={tmp_path}"
    sft = _cfg("dataset=sample_pairs", "dataset.pairs_as=chosen", *SPLIT, "dataset.split.take=sft", cache)
    audit = audit_split(sft.dataset, sft)
    assert audit.ok, audit.render()
    by_row = _ids_of(PAIRS.read_text(encoding="utf-8").splitlines())
    report = BadRowReport(BadRows.error, 0.0)
    read = {"sft": [c.id for c in iter_conversations(sft.dataset, report=report)]}
    for take in ("reward", "rl"):
        cfg = _cfg("objective=dpo", "dataset=sample_pairs", *SPLIT, f"dataset.split.take={take}", cache)
        read[take] = [p.prompt.id for s in resolve_sources(cfg.dataset) for p in iter_pairs(s, report, None, 1 << 20)]
    for take, ids in read.items():
        assert len(ids) == len(set(ids)) and set(ids) == {by_row[r] for r in audit.rows[take]}, take
    assert not set(read["sft"]) & (set(read["reward"]) | set(read["rl"]))
    assert set(read["sft"]) == set(by_row.values()) - set(read["reward"]) - set(read["rl"])
    assert 0.15 < len(read["sft"]) / len(by_row) < 0.25 and report.skipped == 0


def _read_all(cfg, run_dir):
    """{sample id: (input_ids, labels) without padding} of one epoch and the validation rows, as rank 0 reads them."""
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.labels import IGNORE_INDEX
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    plan = plan_like_launcher(cfg, run_dir, 1)
    train, evaluation = build_loaders(cfg, load_tokenizer(cfg), 0, 1, run_dir, plan)
    train.set_epoch(0)
    got = {}
    for batch in list(train) + list(evaluation or []):
        for i, sid in enumerate(batch["ids"]):
            ids, labels = batch["input_ids"][i].tolist(), batch["labels"][i].tolist()
            keep = [k for k, m in enumerate(batch["attention_mask"][i].tolist()) if m]
            got[sid] = ([ids[k] for k in keep], [labels[k] for k in keep])
            assert any(x != IGNORE_INDEX for x in got[sid][1])
    return got


def test_map_and_iterable_deal_the_same_samples(tmp_path):
    args = ["dataset=sample_pairs", "dataset.pairs_as=chosen", *SPLIT, "dataset.split.take=sft", "dataset.val_size=4",
            "dataset.max_samples=null", "data.shuffle=false", "trainer.micro_batch_size=2",
            f"data.cache_dir={tmp_path / 'cache'}"]
    got = {kind: _read_all(_cfg(*args, f"data={kind}"), tmp_path / kind) for kind in ("map", "iterable")}
    assert got["map"] == got["iterable"] and len(got["map"]) > 300


def test_the_cache_key_and_fingerprint_change_with_the_key(tok, tmp_path):
    from dsrecipes.data.prepare.cache import cache_key, data_fingerprint
    from dsrecipes.data.sources.registry import resolve_sources

    keys = {}
    for mode in ("refuse", "chosen"):
        cfg = _cfg("dataset=sample_pairs", f"dataset.pairs_as={mode}", f"data.cache_dir={tmp_path}")
        sources = resolve_sources(cfg.dataset)
        assert [s.pairs_as.value for s in sources] == [mode]  # each source reads the dataset's setting
        keys[mode] = (cache_key(cfg, tok, sources), data_fingerprint(cfg, sources))
    assert keys["refuse"][0] != keys["chosen"][0] and keys["refuse"][1] != keys["chosen"][1]


@pytest.mark.parametrize("argv, says", [
    (["dataset.pairs_as=chosenn"], "error: dataset.pairs_as: invalid value 'chosenn' (expected one of refuse, chosen)"),
    (["objective=dpo", "dataset.pairs_as=chosen"], "error: dataset.pairs_as: chosen reads a pair row as an SFT "
                                                   "conversation (objective=sft); objective.rows=pair reads"),
    ([], "error: dataset: source 'sample_pairs' holds preference (ranking) rows; train on it with an objective on "
         "pairs (objective.rows=pair: objective=dpo, for one), or SFT on each pair's prompt + chosen answer "
         "(DeepSpeed-Chat's step 1) with dataset.pairs_as=chosen"),
])
def test_one_message_exit_2_through_the_cli(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.chdir(tmp_path)
    err = _error_line_of_many(capsys, ["train", "debug=fast", "dataset=sample_pairs", *argv,
                                       f"data.cache_dir={tmp_path / 'cache'}", "trainer.output_dir=runs/x"])
    assert err.startswith(says), err


def test_a_pairs_file_under_sft_by_default_is_refused_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _error_line_of_many(capsys, ["train", "debug=fast", "dataset=sharegpt_files", f"dataset.paths=[{PAIRS}]",
                                       "dataset.val_size=0", "trainer.export=false",
                                       f"data.cache_dir={tmp_path / 'cache'}", "trainer.output_dir=runs/x"])
    assert "this looks like a preference pair" in err and "dataset.pairs_as=chosen" in err, err


def _train(argv, tmp_path, name):
    from dsrecipes.cli import main

    with in_process_environ():
        assert main(["train", "debug=fast", "trainer.max_steps=3", "scheduler.warmup_steps=0", "trainer.export=false",
                     "dataset.val_size=4", f"data.cache_dir={tmp_path / 'cache'}",
                     f"trainer.output_dir={tmp_path / name}", *argv]) == 0
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_short_runs_of_sft_on_the_sft_share_of_a_pairs_file_on_every_strategy(tmp_path):
    from dsrecipes.cli import main

    share = ["dataset=sample_pairs", "dataset.pairs_as=chosen", *SPLIT, "dataset.split.take=sft"]
    assert _train([*share, "data=map"], tmp_path, "map")
    assert _train([*share, "data=iterable"], tmp_path, "iterable")
    shards = tmp_path / "shards"
    with in_process_environ():
        assert main(["shard", "--parts", "1", "--out", str(shards), "--val-size", "4", *share,
                     f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    written = [json.loads(x) for x in (shards / "part_00.jsonl").read_text(encoding="utf-8").splitlines()]
    assert written and all("chosen" not in r and r["conversations"][-1]["from"] == "assistant" for r in written)
    assert _train(["data=presharded", f"data.shard_dir={shards}"], tmp_path, "presharded")


def test_the_dschat_pipeline_reads_one_pairs_file_split_2_4_4(tmp_path):
    """recipes/pipelines/smollm2_dschat_split.yaml: sft (pairs as chosen), reward and dpo read the same pairs file,
    each its own share of {sft:2, reward:4, rl:4}; every stage composes and validates."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.config.pipeline_file import load_pipeline
    from dsrecipes.data.sources.registry import resolve_sources
    from dsrecipes.run.pipeline import check_stages, stage_argv

    pipeline = load_pipeline(REPO / "recipes" / "pipelines" / "smollm2_dschat_split.yaml")
    check_stages(pipeline, tmp_path / "out")
    seen = {}
    for stage in pipeline.stages:
        cfg = compose_and_load(stage_argv(pipeline, stage, tmp_path / "out"), check_files=False)
        (source,) = resolve_sources(cfg.dataset)
        seen[stage.name] = (cfg.objective.kind.value, cfg.dataset.pairs_as.value, source.paths, source.share.take,
                            dict(source.share.shares))
    shares = {"sft": 2, "reward": 4, "rl": 4}
    assert seen == {"sft": ("sft", "chosen", [str(PAIRS)], "sft", shares),
                    "reward": ("reward", "refuse", [str(PAIRS)], "reward", shares),
                    "dpo": ("dpo", "refuse", [str(PAIRS)], "rl", shares)}
    assert dataclasses.is_dataclass(cfg) and Path(PAIRS).is_file()


def test_a_source_of_its_own_reads_its_pairs_as_chosen_in_a_mix(tmp_path):
    """`dataset.sources[i].pairs_as` overrides the dataset's for that source (null: the dataset's); under DPO it is
    refused as the dataset's is."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.choices import BadRows
    from dsrecipes.core.errors import UserError
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.sharegpt import iter_conversations

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"id": "c0", "conversations": HISTORY[:2]}) + "\n", encoding="utf-8")
    mix = [f"dataset.paths=[{chats}]", f"+dataset.sources=[{{name: pairs, paths: [{PAIRS}], pairs_as: chosen, "
                                       "max_samples: 3}]"]
    cfg = _cfg(*mix)
    convs = list(iter_conversations(cfg.dataset, report=BadRowReport(BadRows.error, 0.0)))
    assert [c.id for c in convs][:1] == ["c0"] and len(convs) == 4
    assert [c.turns[-1].content for c in convs[1:]] == [json.loads(x)["chosen"]["value"] for x in
                                                        PAIRS.read_text(encoding="utf-8").splitlines()[:3]]
    with pytest.raises(UserError, match=r"dataset.sources\[0\].pairs_as: chosen reads a pair row"):
        compose_and_load(["objective=dpo", "dataset=sample_pairs", *mix[1:2]])


def test_a_registry_entrys_pairs_as_is_read_by_sft_and_refused_under_dpo(tmp_path, capsys, monkeypatch):
    """A registry entry (dataset.registry YAML) may carry `pairs_as: chosen`: SFT reads its pairs as prompt + chosen,
    and DPO refuses it (one message naming the entry, exit 2, nothing written) instead of ignoring it, as the
    command line's `dataset.pairs_as` is refused there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reg.yaml").write_text(
        f"pairs:\n  paths: [{PAIRS}]\n  format: sharegpt\n  ranking: true\n  pairs_as: chosen\n"
        "  columns: {messages: conversations, chosen: chosen, rejected: rejected}\n", encoding="utf-8")
    use = ["dataset.registry=reg.yaml", "dataset.use=[pairs]", f"data.cache_dir={tmp_path / 'cache'}"]
    err = _error_line_of_many(capsys, ["train", "debug=fast", "objective=dpo", *use, "trainer.output_dir=runs/x"])
    assert err.startswith("error: dataset: source 'pairs' sets pairs_as: chosen, which reads a pair row as an SFT "
                          "conversation (objective=sft); objective.rows=pair reads its rows as they are"), err
    assert not (tmp_path / "runs").exists()
    losses = _train([*use, "dataset.val_size=0"], tmp_path, "sft")  # trained: a pair row is a bad row otherwise
    assert losses and all(0 < x < 100 for x in losses), losses
