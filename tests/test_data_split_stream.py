"""dataset.split under data=iterable: the launching process's index leaves the other shares' lines out of the
training order (data/stream/shares.py).

Hostile: the same split file read by data=map and by data=iterable gives every share the same row ids (training and
validation together; with `dataset.max_samples`, the first rows of the share under both); a bad line of another
share is not this run's bad row; on 2 ranks with 2 DataLoader workers each a share is read exactly once per epoch in
equal micro-batch counts, resumes exactly (same world) and elastically (one rank); `dsrecipes audit` reads each share
as an iterable run's index does and proves them disjoint and covering.
"""

from __future__ import annotations

import json

import pytest

from tests.test_data_split import SHARES, rows

SPLIT = "++dataset.split.shares={sft:2,reward:4,rl:4}"


def cfg_of(path, tmp_path, kind: str, take: str, *more: str):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load([f"data={kind}", f"dataset.paths=[{path}]", SPLIT, f"dataset.split.take={take}",
                             "dataset.val_size=3", "dataset.max_samples=null", "trainer.micro_batch_size=1",
                             "data.shuffle=false", f"data.cache_dir={tmp_path / 'cache'}", *more])


def read_all(cfg, run_dir, world: int = 1):
    """(train ids of epoch 0 per rank, validation ids) as the run's ranks read them."""
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    plan = plan_like_launcher(cfg, run_dir, world)
    tok = load_tokenizer(cfg)
    built = [build_loaders(cfg, tok, r, world, run_dir, plan) for r in range(world)]
    train = []
    for lo, _ in built:
        lo.set_epoch(0)
        train.append([list(b["ids"]) for b in lo])
    held = [i for _, ev in built for b in (ev or []) for i in b["ids"]]
    return train, held, built, plan


@pytest.fixture(scope="module")
def split_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split_stream")
    data = rows(90)
    lines = [json.dumps(r) for r in data]
    lines.insert(40, '{"id": "broken", "conversations": [')  # a bad row: reported by its share's run only
    (tmp / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp, tmp / "a.jsonl"


def test_map_and_iterable_read_the_same_rows_per_share(split_file, tmp_path):
    """A share's rows (trained and held out) are the same under both strategies; `dataset.max_samples` keeps the
    first rows of the share under both (rl: 9 trained + 3 held out)."""
    tmp, path = split_file
    got = {}
    for take, more in (("reward", []), ("rl", ["dataset.max_samples=12"])):
        for kind in ("map", "iterable"):
            cfg = cfg_of(path, tmp_path / kind, kind, take, "dataset.bad_rows=skip", *more)
            train, held, _, _ = read_all(cfg, tmp_path / f"{kind}-{take}")
            ids = [i for b in train[0] for i in b] + held
            assert len(ids) == len(set(ids)) and len(held) == 3
            got[(kind, take)] = set(ids)
        assert got[("map", take)] == got[("iterable", take)], take
    assert len(got[("map", "rl")]) == 12 and not got[("map", "reward")] & got[("map", "rl")]
    cached = sorted((tmp_path / "iterable" / "cache" / "stream").glob("*-share-*.npy"))
    assert len(cached) == 2  # which lines are in the share, per file content and share: read once
    train, held, _, _ = read_all(cfg_of(path, tmp_path / "iterable", "iterable", "reward", "dataset.bad_rows=skip"),
                                 tmp_path / "again")
    assert {i for b in train[0] for i in b} | set(held) == got[("iterable", "reward")]
    assert len(got[("map", "reward")]) > 25  # ~0.4 of 90 (disjoint and covering: the audit test)


def test_a_bad_line_of_another_share_is_not_this_runs(split_file, tmp_path):
    """Under bad_rows=error the run whose share holds the broken line stops naming it; the others train."""
    from dsrecipes.core.errors import DataError
    from dsrecipes.data.sources.split_shares import row_id, share_of_id

    _, path = split_file
    raw = '{"id": "broken", "conversations": ['
    owner = share_of_id(row_id(None, raw, ""), SHARES)
    for take in sorted(SHARES):
        cfg = cfg_of(path, tmp_path / "c", "iterable", take)
        if take == owner:
            with pytest.raises(DataError, match=r"a.jsonl:41"):
                read_all(cfg, tmp_path / take)
        else:
            read_all(cfg, tmp_path / take)


def test_iterable_share_once_equal_steps_exact_and_elastic_resume(split_file, tmp_path):
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.strategies import build_loaders

    _, path = split_file
    cfg = cfg_of(path, tmp_path, "iterable", "reward", "dataset.bad_rows=skip", "data.num_workers=2",
                 "data.shuffle=true", "trainer.micro_batch_size=2")
    map_train, map_held, _, _ = read_all(cfg_of(path, tmp_path, "map", "reward", "dataset.bad_rows=skip"),
                                         tmp_path / "map")
    share = {i for b in map_train[0] for i in b} | set(map_held)
    run_dir = tmp_path / "run"
    train, held, built, plan = read_all(cfg, run_dir, world=2)
    got = [i for r in train for b in r for i in b]
    assert len(got) == len(set(got)) and len({len(r) for r in train}) == 1
    assert set(got) | set(held) <= share and len(share) - len(held) - len(got) < 4  # < one global batch left
    tok = load_tokenizer(cfg)
    states, first = [], []
    for lo, _ in built:
        lo.set_epoch(1)
        lo.set_epoch(0)
        it = iter(lo)
        first += [i for _ in range(2) for i in next(it)["ids"]]
        states.append(lo.state_dict())
    for r, state in enumerate(states):  # exact: the rest of the same plan
        lo, _ = build_loaders(cfg, tok, r, 2, run_dir, plan)
        lo.load_state_dict(state)
        assert [list(b["ids"]) for b in lo] == train[r][2:]
    one = cfg_of(path, tmp_path, "iterable", "reward", "dataset.bad_rows=skip", "data.num_workers=2",
                 "data.shuffle=true", "trainer.micro_batch_size=2", "trainer.grad_accum=2")
    lo, _ = build_loaders(one, tok, 0, 1, run_dir, plan)
    lo.load_state_dict(states[0])
    done = first + [i for b in lo for i in b["ids"]]
    assert len(done) == len(set(done)) and set(done) <= share - set(held)
    assert len(share) - len(held) - len(done) < 4


def test_audit_reads_the_shares_as_an_iterable_run(split_file, capsys):
    from dsrecipes.cli import main

    _, path = split_file
    code = main(["audit", "data=iterable", f"dataset.paths=[{path}]", SPLIT, "dataset.split.take=sft",
                 "dataset.bad_rows=skip", "dataset.val_size=3", "--num-rows", "91"])
    out = capsys.readouterr().out
    assert code == 0 and "OK: the shares are disjoint and cover every row" in out and "91 rows" in out, out
