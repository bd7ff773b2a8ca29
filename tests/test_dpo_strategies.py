"""objective=dpo under data=iterable and data=presharded: a preference pair is one sample for every strategy.

Fast tests on the real data layer (bundled sample pairs, the tiny tokenizer, the launching process's part done as
`python -m dsrecipes` does it, then the loaders of 2 simulated ranks built in this process): every pair id exactly
once per epoch, equal micro-batch counts, DPO batches (2B sequences), held-out pairs disjoint, exact and elastic
resume, the ledger check (`dsrecipes audit --ledger`), and the hostile cases: malformed pairs named by `file:line`
(or counted under `skip`), shard directories of the wrong row kind refused, the precomputed reference refused where
no pass before training exists. One slow test trains 2 ranks with `deepspeed` per strategy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.core.errors import ConfigError, DataError

PAIRS = ["objective=dpo", "objective.reference=live", "dataset=sample_pairs", "data.cutoff_len=256",
         "trainer.micro_batch_size=2", "trainer.grad_accum=2"]
MAX = 60  # dataset.max_samples: pairs of the stream (the first lines)
VAL = 6


def compose(*overrides: str):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load([*PAIRS, *overrides])


@pytest.fixture(scope="module")
def tok():
    from dsrecipes.core.tokenizer import load_tokenizer

    return load_tokenizer(compose())


def launch(cfg, run_dir: Path, world: int, tok):
    """The launching process's part (index, pre-scan or manifest check, run plan), then every rank's loaders."""
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    plan = plan_like_launcher(cfg, run_dir, world)
    return plan, [build_loaders(cfg, tok, r, world, run_dir, plan) for r in range(world)]


def epoch_ids(loaders, epoch: int):
    """{rank: [ids of each micro-batch]} of one epoch; checks the DPO batch layout on the way."""
    out = {}
    for r, lo in enumerate(loaders):
        lo.set_epoch(epoch)
        out[r] = []
        for batch in lo:
            pairs = len(batch["pair_mask"])
            assert batch["input_ids"].shape[0] == 2 * pairs  # chosen then rejected
            assert int(batch["pair_mask"].sum()) == len(batch["ids"])
            out[r].append(list(batch["ids"]))
    return out


def flat(ids):
    return [i for v in ids.values() for b in v for i in b]


def all_pair_ids(cfg):
    """The ids of every pair the stream holds (caps applied), as the sources give them."""
    from dsrecipes.data.render.preference_encode import iter_pairs
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.registry import resolve_sources

    report = BadRowReport(cfg.dataset.bad_rows, 1.0)
    return [p.prompt.id for s in resolve_sources(cfg.dataset) for p in iter_pairs(s, report, MAX, 1 << 20)]


# ---------------------------------------------------------------------------------------------------------------
# data=iterable


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory, tok):
    run_dir = tmp_path_factory.mktemp("iter")
    cfg = compose("data=iterable", f"dataset.max_samples={MAX}", f"dataset.val_size={VAL}", "data.num_workers=2",
                  f"data.cache_dir={run_dir}-cache")
    plan, built = launch(cfg, run_dir, 2, tok)
    return cfg, run_dir, plan, built


def test_iterable_pairs_exactly_once_equal_steps(stream_run):
    cfg, _, plan, built = stream_run
    loaders, evals = zip(*built)
    assert plan.rows == MAX - VAL  # one line, one pair, one sample
    gb = 2 * 2 * 2
    for epoch in (0, 1):
        ids = epoch_ids(loaders, epoch)
        got = flat(ids)
        assert len(got) == len(set(got))
        assert {len(v) for v in ids.values()} == {loaders[0].steps_per_epoch * 2}  # equal micro-batches
        assert len(got) == (MAX - VAL) // gb * gb  # every pair but the remainder under one global batch
    held = [i for ev in evals for b in ev for i in b["ids"]]
    assert len(held) == len(set(held)) == VAL and not set(held) & set(got)
    assert set(got) | set(held) <= set(all_pair_ids(cfg))


def test_iterable_pairs_resume_exact_and_elastic(stream_run, tok):
    """Stop rank loaders after 3 micro-batches at world 2, resume the rest at world 2 (exact) and at world 1
    (elastic): together with what was consumed, every pair once."""
    from dsrecipes.data.strategies import build_loaders

    cfg, run_dir, plan, built = stream_run
    loaders = [lo for lo, _ in built]
    full = epoch_ids(loaders, 0)
    states, first = [], []
    for lo in loaders:
        lo.set_epoch(1)
        lo.set_epoch(0)
        it = iter(lo)
        first += [i for _ in range(3) for i in next(it)["ids"]]
        states.append(lo.state_dict())
    rest = []
    for r, state in enumerate(states):  # same layout: exactly the rest of the original plan
        lo, _ = build_loaders(cfg, tok, r, 2, run_dir, plan)
        lo.load_state_dict(state)
        rest.append([b["ids"] for b in lo])
    assert [full[r][3:] for r in range(2)] == rest
    one = compose("data=iterable", f"dataset.max_samples={MAX}", f"dataset.val_size={VAL}", "data.num_workers=2",
                  f"data.cache_dir={run_dir}-cache", "trainer.grad_accum=4")  # world 1: the same global batch
    lo, _ = build_loaders(one, tok, 0, 1, run_dir, plan)
    lo.load_state_dict(states[0])
    elastic = [i for b in lo for i in b["ids"]]
    done = first + elastic  # 12 consumed at world 2, the remaining 42 re-split for one rank: 5 steps of 8
    assert len(done) == len(set(done)) == 12 + 40
    held = {i for _, ev in built for b in ev for i in b["ids"]}
    assert set(done) <= set(all_pair_ids(cfg)) - held  # and 54 - 52 < one global batch left out


def test_iterable_pair_ledger_passes_audit(stream_run, tmp_path):
    """The ledger a run writes (per micro-batch, pair ids) is what `dsrecipes audit --ledger` checks."""
    from dsrecipes.commands.audit import main as audit_main
    from dsrecipes.data.plan.ledger import LedgerWriter

    _, _, _, built = stream_run
    loaders = [lo for lo, _ in built]
    for r, ids in epoch_ids(loaders, 0).items():
        with LedgerWriter(tmp_path, r) as ledger:
            for micro, batch in enumerate(ids):
                ledger.record(0, micro // 2 + 1, batch)
    assert audit_main(["--ledger", str(tmp_path)]) == 0
    with LedgerWriter(tmp_path, 1) as ledger:  # a pair trained twice in the epoch: the audit fails
        ledger.record(0, 99, [ids[0][0][0]])
    assert audit_main(["--ledger", str(tmp_path)]) == 1


def test_iterable_audit_plans_pairs(tmp_path):
    from dsrecipes.data.strategies import audit_config

    cfg = compose("data=iterable", f"dataset.max_samples={MAX}", f"dataset.val_size={VAL}", "data.num_workers=2",
                  f"data.cache_dir={tmp_path}")
    report = audit_config(cfg, 2, 2)
    assert report.ok, report


def malformed_pairs(tmp_path: Path) -> Path:
    good = {"conversations": [{"from": "human", "value": "2 + 2?"}], "chosen": {"from": "gpt", "value": "4"},
            "rejected": {"from": "gpt", "value": "5"}}
    rows = [dict(good, id=f"p{i}") for i in range(12)]
    rows[3] = {k: v for k, v in rows[3].items() if k != "rejected"}  # line 4: missing_side
    rows[7] = dict(rows[7], rejected=rows[7]["chosen"])  # line 8: identical_sides
    rows[9] = dict(rows[9], chosen={"from": "human", "value": "4"})  # line 10: side_not_assistant
    rows[10] = dict(rows[10], conversations=[{"from": "human", "value": "long " * 400}])  # 11: prompt_too_long
    path = tmp_path / "bad_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def pairs_file(path: Path, *more: str):
    return compose("data=iterable", f"dataset.paths=[{path}]", "dataset.use=[]", "dataset.registry=null",
                   "dataset.val_size=0", "dataset.max_samples=null", *more)


def test_iterable_malformed_pairs_named_by_file_line(tmp_path, tok):
    path = malformed_pairs(tmp_path)
    cfg = pairs_file(path, "dataset.bad_rows=error", f"data.cache_dir={tmp_path}/c")
    with pytest.raises(DataError, match=r"bad_pairs.jsonl:4\b.*missing_side"):
        launch(cfg, tmp_path / "run", 2, tok)
    skip = pairs_file(path, "dataset.bad_rows=skip", "dataset.max_bad_fraction=0.5", f"data.cache_dir={tmp_path}/c")
    plan, built = launch(skip, tmp_path / "run2", 2, tok)
    quarantine = [json.loads(x) for x in (tmp_path / "run2" / "quarantine.jsonl").read_text().splitlines()]
    assert sorted((q["line"], q["reason"]) for q in quarantine) == [
        (4, "missing_side"), (8, "identical_sides"), (10, "side_not_assistant"), (11, "prompt_too_long")]
    assert plan.rows == 12 and all(q["file"] == str(path) for q in quarantine)  # lines, as for conversations
    loaders = [lo for lo, _ in built]
    got = flat(epoch_ids(loaders, 0))  # the workers skip the same rows: their slots stay empty, no pair moves
    assert len(got) == len(set(got)) and not {"p3", "p7", "p9", "p10"} & set(got)


def test_iterable_loader_workers_count_bad_pairs_without_prescan(tmp_path, tok):
    """With data.prescan=false the loader workers meet the bad pairs: `error` names file:line mid-stream."""
    path = malformed_pairs(tmp_path)
    cfg = pairs_file(path, "dataset.bad_rows=error", "data.prescan=false", "data.shuffle=false",
                     f"data.cache_dir={tmp_path}/c", "trainer.micro_batch_size=1", "trainer.grad_accum=1")
    _, built = launch(cfg, tmp_path / "run", 1, tok)
    with pytest.raises(DataError, match=r"bad_pairs.jsonl:4\b"):
        list(built[0][0])


def test_iterable_pair_repeats_of_a_weight_are_samples_of_their_own(tmp_path, tok):
    """A source of weight 2: every pair twice per epoch, the repeat as `<id>@1`, still each id once."""
    path = tmp_path / "pairs.jsonl"
    good = {"conversations": [{"from": "human", "value": "2 + 2?"}], "chosen": {"from": "gpt", "value": "4"},
            "rejected": {"from": "gpt", "value": "5"}}
    path.write_text("".join(json.dumps(dict(good, id=f"p{i}")) + "\n" for i in range(8)), encoding="utf-8")
    cfg = compose("data=iterable", "dataset.paths=[]", "dataset.use=[]", "dataset.registry=null",
                  f"dataset.sources=[{{name: a, paths: [{path}], weight: 2.0}}]", "dataset.val_size=0",
                  "dataset.max_samples=null", f"data.cache_dir={tmp_path}/c")
    plan, built = launch(cfg, tmp_path / "run", 2, tok)
    got = flat(epoch_ids([lo for lo, _ in built], 0))
    assert plan.rows == 16 and sorted(got) == sorted([f"p{i}" for i in range(8)] + [f"p{i}@1" for i in range(8)])


def test_precomputed_reference_refused_for_streams(pair_shards):
    from dsrecipes.config.load import compose_and_load

    for kind in (["data=iterable"], ["data=presharded", f"data.shard_dir={pair_shards[0]}"]):
        with pytest.raises(ConfigError, match=r"objective.reference: .*objective.reference=live"):
            compose_and_load(["objective=dpo", "dataset=sample_pairs", *kind])


# ---------------------------------------------------------------------------------------------------------------
# data=presharded


@pytest.fixture(scope="module")
def pair_shards(tmp_path_factory):
    """`dsrecipes shard ... objective=dpo --parts 2 --val-size 6` over the first 60 pairs."""
    from dsrecipes.data.shard.build import shard

    out = tmp_path_factory.mktemp("shards") / "pairs"
    cfg = compose(f"dataset.max_samples={MAX}", f"data.cache_dir={out}-cache")
    manifest = shard(cfg, 2, str(out), val_size=VAL)
    return out, manifest


def test_shard_writes_pairs_the_pair_reader_reads(pair_shards):
    from dsrecipes.data.shard.rows import PAIR_ROW_FORMAT

    out, manifest = pair_shards
    assert manifest.row_format == PAIR_ROW_FORMAT and manifest.counts == [27, 27] and manifest.val_count == VAL
    assert json.loads((out / "manifest.json").read_text())["row_format"] == PAIR_ROW_FORMAT
    first = json.loads((out / manifest.files[0]).read_text().splitlines()[0])
    assert set(first) >= {"id", "conversations", "chosen", "rejected"}
    assert first["chosen"]["from"] == first["rejected"]["from"] == "assistant"
    assert manifest.checked_with["cutoff_len"] == 256


def test_presharded_pairs_exactly_once_equal_steps(pair_shards, tmp_path, tok):
    out, manifest = pair_shards
    cfg = compose("data=presharded", f"data.shard_dir={out}", "data.num_workers=2", f"data.cache_dir={tmp_path}/c")
    plan, built = launch(cfg, tmp_path / "run", 2, tok)
    loaders, evals = zip(*built)
    assert plan.rows == 54
    parts = [{json.loads(x)["id"] for x in (out / f).read_text().splitlines()} for f in manifest.files]
    for epoch in (0, 1):
        ids = epoch_ids(loaders, epoch)
        assert {len(v) for v in ids.values()} == {12}  # 27 pairs a part // (2 x 2) = 6 steps of 2 micro-batches
        for r in range(2):  # each rank reads only its own part, each pair once
            own = [i for b in ids[r] for i in b]
            assert len(own) == len(set(own)) == 24 and set(own) <= parts[r]
    held = [i for ev in evals for b in ev for i in b["ids"]]
    assert len(held) == len(set(held)) == VAL and not set(held) & (parts[0] | parts[1])


def test_presharded_resume_exact(pair_shards, tmp_path, tok):
    from dsrecipes.data.strategies import build_loaders

    out, _ = pair_shards
    cfg = compose("data=presharded", f"data.shard_dir={out}", f"data.cache_dir={tmp_path}/c")
    plan, built = launch(cfg, tmp_path / "run", 2, tok)
    full = epoch_ids([lo for lo, _ in built], 0)
    for r, (lo, _) in enumerate(built):
        lo.set_epoch(1)
        lo.set_epoch(0)
        it = iter(lo)
        for _ in range(5):
            next(it)
        again, _ = build_loaders(cfg, tok, r, 2, tmp_path / "run", plan)
        again.load_state_dict(lo.state_dict())
        assert [b["ids"] for b in again] == full[r][5:]


def test_shard_kinds_are_not_mixed(pair_shards, tmp_path, tok):
    """A shard directory made for SFT rows under objective=dpo, and pairs under SFT: refused, naming the fix."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.shard.build import shard

    sft_dir = tmp_path / "sft"
    shard(compose_and_load(["dataset.max_samples=20", f"data.cache_dir={tmp_path}/c"]), 2, str(sft_dir))
    dpo = compose("data=presharded", f"data.shard_dir={sft_dir}", f"data.cache_dir={tmp_path}/c")
    with pytest.raises(DataError, match=r"holds conversations \(SFT rows\).*trains on preference pairs "
                                        r"\(objective.rows=pair\).*dsrecipes shard .*objective="):
        launch(dpo, tmp_path / "run", 2, tok)
    sft = compose_and_load(["data=presharded", f"data.shard_dir={pair_shards[0]}", f"data.cache_dir={tmp_path}/c"])
    with pytest.raises(DataError, match=r"holds preference pairs.*trains on conversations.*objective.rows=conversation"):
        launch(sft, tmp_path / "run2", 2, tok)


def test_shard_for_dpo_checks_rows_as_pairs_and_prints_a_live_reference_command(tmp_path):
    from dsrecipes.commands.shard import training_command
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.shard.build import shard

    with pytest.raises(DataError, match=r"train.jsonl:1: missing_side \(no 'chosen' and no 'rejected'"):  # SFT rows, no pairs
        shard(compose_and_load(["objective=dpo", "objective.reference=live", "dataset.max_samples=20"]), 2,
              str(tmp_path / "x"))
    assert training_command(str(tmp_path), 2, ["objective=dpo"]).endswith("objective.reference=live")


# ---------------------------------------------------------------------------------------------------------------
# Two real ranks: `python -m dsrecipes ... launcher=deepspeed launcher.num_gpus=2`


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["iterable", "presharded"])
def test_two_rank_dpo_run(kind, pair_shards, tmp_path):
    """A few DPO steps on 2 ranks with the tiny model: the run ends ok, reports rewards, and its pair ledger passes
    `dsrecipes audit --ledger` (no pair twice, equal steps)."""
    from dsrecipes.data.plan.ledger import verify_ledgers
    from tests.test_train_runs import metrics, train_run

    data = (["data=presharded", f"data.shard_dir={pair_shards[0]}"] if kind == "presharded" else
            ["data=iterable", f"dataset.max_samples={MAX}", f"dataset.val_size={VAL}"])
    run, _ = train_run(tmp_path, "run", *PAIRS, *data, "trainer.max_steps=3", "trainer.eval_every=3",
                       "trainer.save_every=100", "trainer.record_samples=true", "trainer.export=false")
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == 3
    rows = metrics(run)
    first = next(r for r in rows if "loss" in r)
    assert first["loss"] == pytest.approx(0.6931, abs=1e-3) and "reward_accuracy" in first  # policy == reference
    assert any("eval_reward_accuracy" in r for r in rows)
    report = verify_ledgers(run, global_batch=8)
    assert report.ok, report.summary()
    assert report.steps_per_rank == {0: 3, 1: 3} and report.samples_per_rank == {0: 12, 1: 12}
