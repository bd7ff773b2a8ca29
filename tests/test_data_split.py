"""dataset.split (DeepSpeed-Chat's --data_split 2,4,4): one dataset dealt into named step shares by a stable row id.

Hostile: the same rows written in another file order, row order, key order and spacing land in the same shares;
shares are disjoint and cover the data (the audit reads each share through the code runs read with); a run's share
is the same whatever the world size (`dsrecipes shard` into 1 and into 2 parts); a pinned (SFT-only) source stays
whole in its share; a split the strategy cannot honour, or a share that does not exist, is refused by name."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from dsrecipes.core.choices import BadRows, DataKind
from dsrecipes.core.schema import DatasetConfig, SourceConfig, SplitConfig
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.sharegpt import iter_conversations
from dsrecipes.data.sources.split_shares import row_id, share_of_id, split_problems, with_take
from dsrecipes.data.strategies.split_audit import audit_split

SHARES = {"sft": 2, "reward": 4, "rl": 4}


def rows(n: int, tag: str = "q"):
    return [{"id": f"{tag}{i}", "conversations": [{"from": "human", "value": f"{tag} {i}?"},
                                                  {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)]


def write(path: Path, items, shuffle_keys: bool = False) -> str:
    lines = []
    for row in items:
        if shuffle_keys:  # other key order and spacing: the same row
            row = dict(reversed(list(row.items())))
            lines.append(json.dumps(row, indent=None, separators=(" , ", " : ")))
        else:
            lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def dataset(paths, **split) -> DatasetConfig:
    return DatasetConfig(name="d", paths=list(paths), split=SplitConfig(shares=dict(SHARES), **split))


def share_ids(ds: DatasetConfig):
    audit = audit_split(ds)
    assert audit.ok, audit.render()
    return {name: set(ids) for name, ids in audit.rows.items()}


def test_row_id_is_the_row_not_its_spelling_and_shares_follow_the_weights():
    assert row_id({"a": 1, "b": [1, "é"]}) == row_id(json.loads('{ "b" : [1, "\\u00e9"], "a" : 1 }'))
    assert row_id({"a": 1}) != row_id({"a": 2})
    counts = {name: 0 for name in SHARES}
    for i in range(5000):
        counts[share_of_id(row_id({"i": i}), SHARES)] += 1
    assert all(abs(counts[k] / 5000 - SHARES[k] / 10) < 0.03 for k in SHARES), counts
    # the order the shares are written in does not move rows between them
    assert all(share_of_id(row_id({"i": i}), SHARES) == share_of_id(row_id({"i": i}), dict(reversed(SHARES.items())))
               for i in range(200))


def test_shares_are_disjoint_cover_the_data_and_ignore_file_and_row_order(tmp_path):
    data = rows(300)
    a = dataset([write(tmp_path / "a1.jsonl", data[:150]), write(tmp_path / "a2.jsonl", data[150:])])
    shuffled = data[:]
    random.Random(0).shuffle(shuffled)
    b = dataset([write(tmp_path / "b2.jsonl", shuffled[:100], True), write(tmp_path / "b1.jsonl", shuffled[100:], True)])
    first, second = share_ids(a), share_ids(b)
    assert first == second
    assert sum(len(v) for v in first.values()) == 300 and all(len(v) > 30 for v in first.values())
    # a run reads its share only: the conversations `take=reward` yields are exactly that share's rows
    read = list(iter_conversations(with_take(a, "reward"), report=BadRowReport(BadRows.error, 0.0)))
    assert len(read) == len(first["reward"])


def test_duplicates_stay_together_and_the_audit_counts_them(tmp_path):
    data = rows(60)
    ds = dataset([write(tmp_path / "a.jsonl", data + data[:10])])
    audit = audit_split(ds)
    assert audit.ok and sum(audit.total.values()) == 70
    assert all(sum(c.values()) == sum(audit.total[i] for i in c) for c in audit.rows.values())


def test_a_pinned_sft_only_source_stays_whole_in_its_share(tmp_path):
    chat = SourceConfig(name="chat_only", paths=[write(tmp_path / "chat.jsonl", rows(40, "c"))])
    ds = dataclasses.replace(dataset([write(tmp_path / "a.jsonl", rows(100))], pin={"chat_only": "sft"}),
                             sources=[chat])
    audit = audit_split(ds)
    assert audit.ok, audit.render()
    chat_ids = {row_id(r) for r in rows(40, "c")}
    assert chat_ids <= set(audit.rows["sft"]) and not chat_ids & (set(audit.rows["reward"]) | set(audit.rows["rl"]))


def test_the_share_is_the_same_for_one_rank_and_two(tmp_path, make_cfg):
    from dsrecipes.data.shard.build import shard

    path = write(tmp_path / "a.jsonl", rows(120))
    cfg = make_cfg(f"dataset.paths=[{path}]", "++dataset.split.shares={sft:2,reward:4,rl:4}",
                   "dataset.split.take=reward", "dataset.val_size=0")
    read = {}
    for parts in (1, 2):
        manifest = shard(cfg, parts, str(tmp_path / f"p{parts}"))
        texts = [line for f in manifest.files for line in (tmp_path / f"p{parts}" / f).read_text().splitlines()]
        read[parts] = sorted(texts)
    assert read[1] == read[2] and len(read[1]) == len(share_ids(dataset([path]))["reward"])


@pytest.mark.parametrize("split, kind, expected", [
    ({"take": "rewrd"}, DataKind.map, "dataset.split.take: 'rewrd' is not a share (shares: reward, rl, sft)"),
    ({"take": None}, DataKind.map, "dataset.split.take: which share this run reads"),
    ({"take": "sft", "pin": {"x": "sf"}}, DataKind.map, "dataset.split.pin.x: 'sf' is not a share"),
    ({"take": "sft"}, DataKind.presharded, "dataset.split: data=presharded reads parts written by `dsrecipes shard`"),
])
def test_a_split_that_cannot_be_honoured_is_refused_by_name(split, kind, expected):
    """(data=iterable reads a share: test_data_split_stream.py)"""
    import dataclasses

    from dsrecipes.core.schema import TrainConfig
    from dsrecipes.data.strategies.rules import config_problems

    ds = dataset(["x.jsonl"], **split)
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, kind=kind), dataset=ds)
    problems = split_problems(ds, kind) + [p for p in config_problems(cfg) if p.startswith("dataset.split")]
    assert len(problems) == 1 and problems[0].startswith(expected), problems
    bad = DatasetConfig(split=SplitConfig(shares={"a": 0, "b": 1}, take="b"))
    assert split_problems(bad, DataKind.map) == [
        "dataset.split.shares.a: a whole number >= 1 (a weight, as in --data_split 2,4,4), got 0"]


def test_audit_command_proves_the_shares(capsys):
    from dsrecipes.cli import main

    code = main(["audit", "dataset=sample_pairs", "objective=dpo", "++dataset.split.shares={reward:1,dpo:1}",
                 "dataset.split.take=reward", "--num-rows", "64"])
    out = capsys.readouterr().out
    assert code == 0 and "OK: the shares are disjoint and cover every row" in out, out
