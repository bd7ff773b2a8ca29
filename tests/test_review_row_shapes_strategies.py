"""TRL's prompt/completion rows (data/sources/row_shapes.py) and SFT on preference pairs (`dataset.pairs_as=chosen`)
under data=map, data=iterable and data=presharded (`dsrecipes shard`), 2 ranks x 2 DataLoader workers. Fast (loaders
of 2 simulated ranks in this process, as test_dpo_strategies): every sample once an epoch as exactly the tokens and
labels of the conversation it stands for, equal micro-batches, plan and ledger audits pass; exact and elastic 2 -> 1
resume (presharded: refused, naming the re-shard); bad rows kept, skipped and named alike in every strategy; no
preparation, scan or shard reused across `pairs_as`; the re-shard hint keeps how the rows are read, and a refused
shard's quarantine is where its message says. Slow: real
2-rank `deepspeed` runs (record_samples) killed while saving, resumed, then resumed on 1 rank; `audit --ledger`.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError
from tests.conftest import REPO, in_process_environ

PAIRS = REPO / "dsrecipes" / "assets" / "sample_data" / "pairs.jsonl"
ROWS = 40  # per file: 2 ranks x micro 2 x accum 2 = 8 a step, 5 steps an epoch, no remainder
KINDS = ("map", "iterable", "presharded")
SHAPES = ("trl", "pairs")
OPENAI = ("messages", "role", "content")


def _msgs(*turns):
    return [{"role": role, "content": content} for role, content in turns]


def trl_rows():
    """TRL's two prompt/completion shapes, alternating; no `id`: the sample id is `trl.jsonl:<line>`."""
    return [{"prompt": f"What is {i} + {i}?", "completion": f"{i} + {i} = {2 * i}."} if i % 2 else
            {"prompt": _msgs(("system", "Be terse."), ("user", f"Hi {i}"), ("assistant", f"Hello {i}."),
                             ("user", f"Double {i}?")), "completion": _msgs(("assistant", f"{2 * i}."))}
            for i in range(ROWS)]


def as_messages(row):
    """The `messages` row a TRL row stands for: the prompt's answer is context (OpenAI's weight 0)."""
    if isinstance(row["prompt"], str):
        return {"messages": _msgs(("user", row["prompt"]), ("assistant", row["completion"]))}
    prompt = [dict(m, weight=0) if m["role"] == "assistant" else m for m in row["prompt"]]
    return {"messages": prompt + row["completion"]}


def as_conversation(pair):
    """The ShareGPT conversation a pair stands for under pairs_as=chosen: its prompt + the chosen answer."""
    conv = {k: v for k, v in pair.items() if k not in ("chosen", "rejected")}
    return {**conv, "conversations": pair["conversations"] + [pair["chosen"]]}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def data_args(shape: str, path: Path, pairs_as: str = "chosen"):
    reader = "openai_messages" if shape == "trl" else "sharegpt_files"
    return [f"dataset={reader}", f"dataset.paths=[{path}]", f"dataset.pairs_as={pairs_as}"]


COMMON = ["dataset.val_size=0", "dataset.max_samples=null", "data.cutoff_len=256"]


def compose(*overrides: str):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load([*COMMON, "data.num_workers=2", "trainer.micro_batch_size=2", "trainer.grad_accum=2",
                             *overrides])


def shard_cli(out: Path, *argv: str) -> tuple[int, str]:
    from dsrecipes.cli import main

    buf = io.StringIO()
    with in_process_environ(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = main(["shard", "--out", str(out), *argv])
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """The two files, their expected (input_ids, labels) per sample id, the tokenizer and a 2-part shard of each."""
    from dsrecipes.core.schema import ColumnsConfig, DatasetFormat, SourceConfig
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.sharegpt import normalize_row

    root = tmp_path_factory.mktemp("row_shapes")
    trl = trl_rows()
    pairs = [json.loads(x) for x in PAIRS.read_text(encoding="utf-8").splitlines()[:ROWS]]
    files = {"trl": write_jsonl(root / "trl.jsonl", trl), "pairs": write_jsonl(root / "pairs.jsonl", pairs)}
    cfg = compose(*data_args("trl", files["trl"]), f"data.cache_dir={root / 'cache'}")
    tok = load_tokenizer(cfg)
    encoder = Encoder(tok, cfg)
    openai = SourceConfig(name="s", format=DatasetFormat.openai, columns=ColumnsConfig(**dict(zip(OPENAI, OPENAI))))

    def encoded(row, source):
        e = encoder.encode(normalize_row(row, "x", source))
        return e.input_ids, e.labels

    expected = {"trl": {f"trl.jsonl:{n}": encoded(as_messages(r), openai) for n, r in enumerate(trl, 1)},
                "pairs": {p["id"]: encoded(as_conversation(p), SourceConfig(name="s")) for p in pairs}}
    shards = {}
    for shape in SHAPES:
        shards[shape] = root / f"shards-{shape}"
        code, out = shard_cli(shards[shape], "--parts", "2", *data_args(shape, files[shape]), *COMMON,
                              f"data.cache_dir={root / 'cache'}")
        assert code == 0, out
    yield root, files, expected, tok, shards
    from dsrecipes.data.strategies.base import end_workers

    end_workers()  # loaders left mid-epoch by the resume tests: their workers ignore SIGTERM


def cfg_of(ws, shape: str, kind: str, *more: str):
    root, files, _, _, shards = ws
    shard = [f"data.shard_dir={shards[shape]}"] if kind == "presharded" else []
    return compose(*data_args(shape, files[shape]), f"data={kind}", *shard, f"data.cache_dir={root / 'cache'}",
                   "data.shuffle=true", *more)


def launch(cfg, run_dir: Path, world: int, tok):
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    with contextlib.redirect_stdout(io.StringIO()):
        plan = plan_like_launcher(cfg, run_dir, world)
    return plan, [build_loaders(cfg, tok, r, world, run_dir, plan)[0] for r in range(world)]


def read_epoch(loaders, epoch: int):
    """({rank: [ids of each micro-batch]}, {sample id: (input_ids, labels) without padding})."""
    per_rank, samples = {}, {}
    for r, lo in enumerate(loaders):
        lo.set_epoch(epoch)
        per_rank[r] = []
        for batch in lo:
            per_rank[r].append(list(batch["ids"]))
            for i, sid in enumerate(batch["ids"]):
                keep = [k for k, m in enumerate(batch["attention_mask"][i].tolist()) if m]
                ids, labels = batch["input_ids"][i].tolist(), batch["labels"][i].tolist()
                assert sid not in samples, f"{sid} read twice in epoch {epoch}"
                samples[sid] = ([ids[k] for k in keep], [labels[k] for k in keep])
    return per_rank, samples


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_sample_once_as_exactly_its_tokens_and_the_audits_pass(ws, shape, kind, tmp_path):
    from dsrecipes.commands.audit import main as audit_main
    from dsrecipes.data.plan.ledger import LedgerWriter
    from dsrecipes.data.strategies import audit_config

    _, _, expected, tok, _ = ws
    cfg = cfg_of(ws, shape, kind)
    plan, loaders = launch(cfg, tmp_path / "run", 2, tok)
    assert plan.rows == ROWS
    for epoch in (0, 1):
        per_rank, samples = read_epoch(loaders, epoch)
        assert [len(v) for v in per_rank.values()] == [10, 10]  # 20 samples a rank, micro-batches of 2
        assert set(samples) == set(expected[shape])  # no remainder: every sample, once
        wrong = [s for s in samples if samples[s] != expected[shape][s]]
        assert not wrong, (shape, kind, wrong[:3])
    for r, micro in per_rank.items():  # the ledger a run writes for the last epoch read
        with LedgerWriter(tmp_path / "ledger", r) as ledger:
            for m, ids in enumerate(micro):
                ledger.record(1, m // 2 + 1, ids)
    with contextlib.redirect_stdout(io.StringIO()):
        assert audit_main(["--ledger", str(tmp_path / "ledger")]) == 0
    report = audit_config(cfg, 2, 2)
    assert report.ok, report


def test_the_prompt_is_context_and_only_the_answer_is_trained(ws):
    """The expectation itself, decoded: the trained tokens are the completion / chosen answer (and end of turn)."""
    from dsrecipes.data.render.labels import IGNORE_INDEX

    _, _, expected, tok, _ = ws

    trained = [tok.decode([t for t, label in zip(*expected[shape][sid]) if label != IGNORE_INDEX])
               for shape, sid in (("trl", "trl.jsonl:1"), ("trl", "trl.jsonl:2"), ("pairs", "sample-00000"))]
    assert trained[0].startswith("0.") and "Hello" not in trained[0] and trained[1].startswith("1 + 1 = 2.")
    assert trained[2].startswith("29 + 30 = 59.")  # the chosen answer; the rejected one says 69


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_and_elastic_resume(ws, shape, kind, tmp_path):
    """Stopped after 2 steps (4 micro-batches a rank) of epoch 0: the same layout reads exactly the rest; one rank
    with grad_accum 4 (the same global batch) reads every other sample of the epoch once (map, iterable); a
    presharded run of 2 parts on one rank is refused, naming the re-shard."""
    from dsrecipes.data.strategies import build_loaders

    _, _, expected, tok, _ = ws
    cfg = cfg_of(ws, shape, kind)
    run_dir = tmp_path / "run"
    plan, loaders = launch(cfg, run_dir, 2, tok)
    full, _ = read_epoch(loaders, 0)
    states, first = [], []
    for lo in loaders:
        lo.set_epoch(1)
        lo.set_epoch(0)  # epoch 0 again, from its start (it was read to the end)
        it = iter(lo)
        first += [i for _ in range(4) for i in next(it)["ids"]]
        states.append(lo.state_dict())
        it.close()
    rest = []
    for r, state in enumerate(states):
        lo = build_loaders(cfg, tok, r, 2, run_dir, plan)[0]
        lo.load_state_dict(state)
        rest.append([list(b["ids"]) for b in lo])
    assert rest == [full[r][4:] for r in range(2)]
    one = cfg_of(ws, shape, kind, "trainer.grad_accum=4")
    if kind == "presharded":
        with pytest.raises(DataError, match=r"holds 2 parts but the run has 1 ranks.*dsrecipes shard .* --parts 1"):
            build_loaders(one, tok, 0, 1, run_dir, plan)
        return
    lo = build_loaders(one, tok, 0, 1, run_dir, plan)[0]
    lo.load_state_dict(states[0])
    done = first + [i for b in lo for i in b["ids"]]
    assert len(done) == len(set(done)) and set(done) == set(expected[shape])


# ---------------------------------------------------------------------------------------------------------------
# Bad rows: the same rows kept and skipped, the same message, in every strategy


def bad_trl_rows():
    rows = [{"prompt": f"What is {i}+{i}?", "completion": f"{2 * i}"} for i in range(12)]
    rows[1] = {"messages": _msgs(("user", "hi"), ("assistant", "hello"))}  # 2: another shape, read
    rows[3] = {"prompt": "x", "completion": 5}  # 4: a non-string completion
    rows[4] = {"prompt": "x", "completion": _msgs(("assistant", "y"))}  # 5: mixed types
    rows[6] = {"prompt": "q", "chosen": "", "rejected": "b"}  # 7: a pair, its chosen empty
    rows[7] = {"prompt": "q", "chosen": "c", "rejected": "b"}  # 8: a pair
    rows[9] = {"prompt": "q", "completion": "a", "chosen": "c", "rejected": "d"}  # 10: a completion and a pair
    rows[10] = {"prompt": _msgs(("user", "u")), "completion": None}  # 11
    return rows


def bad_pair_rows():
    rows = [json.loads(x) for x in PAIRS.read_text(encoding="utf-8").splitlines()[:12]]
    for row in rows:
        row.pop("id")
    rows[2] = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}  # 3: read
    rows[4] = dict(rows[4], chosen={"from": "gpt", "value": ""})  # 5: empty chosen
    rows[6] = {k: v for k, v in rows[6].items() if k != "rejected"}  # 7: one side
    rows[8] = {"prompt": "x", "completion": 5}  # 9: a TRL row with a non-string completion
    rows[9] = dict(rows[9], chosen=[])  # 10
    return rows


BAD = {  # (shape, pairs_as): (rows, lines kept, (line, reason) skipped)
    ("trl", "refuse"): (bad_trl_rows, [1, 2, 3, 6, 9, 12], [(4, "bad_value"), (5, "bad_value"),
                                                           (7, "missing_conversation"), (8, "missing_conversation"),
                                                           (10, "preference_row"), (11, "bad_value")]),
    ("trl", "chosen"): (bad_trl_rows, [1, 2, 3, 6, 8, 9, 10, 12], [(4, "bad_value"), (5, "bad_value"),
                                                                   (7, "empty_answer"), (11, "bad_value")]),
    ("pairs", "chosen"): (bad_pair_rows, [1, 2, 3, 4, 6, 8, 11, 12], [(5, "empty_answer"), (7, "missing_side"),
                                                                      (9, "missing_conversation"),
                                                                      (10, "side_not_assistant")]),
}


def read_under_policy(tmp_path: Path, path: Path, shape: str, pairs_as: str, policy: str, kind: str, tok):
    """(sorted sample ids of one epoch on 1 rank, [(line, reason, detail)] quarantined), or the DataError text."""
    argv = [*data_args(shape, path, pairs_as), f"dataset.bad_rows={policy}", "dataset.max_bad_fraction=0.9",
            f"data.cache_dir={tmp_path / 'cache' / kind}", "data.shuffle=false"]
    quarantine = tmp_path / kind / "quarantine.jsonl"
    shard = []
    if kind == "presharded":
        code, out = shard_cli(tmp_path / "shards", "--parts", "1", *argv, *COMMON)
        if code:
            return re.sub(r"^error: ", "", out.strip().splitlines()[-1])
        shard, quarantine = [f"data.shard_dir={tmp_path / 'shards'}"], tmp_path / "shards" / "quarantine.jsonl"
    cfg = compose(*argv, f"data={kind}", *shard, "trainer.micro_batch_size=1", "trainer.grad_accum=1")
    try:
        _, (lo,) = launch(cfg, tmp_path / kind, 1, tok)
        lo.set_epoch(0)
        ids = sorted(int(i.rsplit(":", 1)[1]) for b in lo for i in b["ids"])
    except DataError as exc:
        return str(exc)
    entries = [json.loads(x) for x in quarantine.read_text().splitlines()] if quarantine.exists() else []
    return ids, [(e["line"], e["reason"], e["detail"]) for e in entries]


@pytest.mark.parametrize("policy", ["skip", "error"])
@pytest.mark.parametrize("shape, pairs_as", sorted(BAD))
def test_bad_rows_are_kept_skipped_and_named_alike_in_every_strategy(ws, tmp_path, shape, pairs_as, policy):
    rows, kept, skipped = BAD[(shape, pairs_as)]
    path = write_jsonl(tmp_path / f"{shape}.jsonl", rows())
    got = {kind: read_under_policy(tmp_path, path, shape, pairs_as, policy, kind, ws[3]) for kind in KINDS}
    assert got["iterable"] == got["map"] == got["presharded"], got
    if policy == "skip":
        ids, entries = got["map"]
        assert ids == kept and [(line, reason) for line, reason, _ in entries] == skipped
    else:
        line, reason = skipped[0]
        assert got["map"].startswith(f"{path}:{line}: {reason} ("), got["map"]


# ---------------------------------------------------------------------------------------------------------------
# Identity: no preparation of one reading is reused by another


@pytest.mark.parametrize("kind", KINDS)
def test_a_change_of_pairs_as_reuses_no_preparation_scan_or_shard(ws, tmp_path, kind):
    """A file of 10 pairs and 10 conversations under bad_rows=skip: refuse trains the 10 conversations, chosen all
    20, in either order on the same cache directory (and shard directory, written again with --force)."""
    lines = PAIRS.read_text(encoding="utf-8").splitlines()[:10]
    lines += (REPO / "dsrecipes" / "assets" / "sample_data" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:10]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for order in (("refuse", "chosen"), ("chosen", "refuse")):
        for mode in order:
            argv = [*data_args("pairs", path, mode), "dataset.bad_rows=skip", "dataset.max_bad_fraction=0.9",
                    f"data.cache_dir={tmp_path / order[0]}", "data.shuffle=false"]
            shard = []
            if kind == "presharded":
                code, out = shard_cli(tmp_path / f"shards-{order[0]}", "--parts", "1", "--force", *argv, *COMMON)
                assert code == 0, out
                shard = [f"data.shard_dir={tmp_path / f'shards-{order[0]}'}"]
            cfg = compose(*argv, f"data={kind}", *shard, "trainer.micro_batch_size=1", "trainer.grad_accum=1")
            _, (lo,) = launch(cfg, tmp_path / f"{order[0]}-{mode}", 1, ws[3])
            lo.set_epoch(0)
            assert len([i for b in lo for i in b["ids"]]) == (20 if mode == "chosen" else 10), (order, mode)


def test_the_reshard_hint_keeps_how_the_rows_are_read(ws, tmp_path):
    """Followed as printed it shards the pairs without dataset.pairs_as=chosen (refused; TRL rows: every row bad)."""
    from dsrecipes.data.strategies import build_loaders

    plan, _ = launch(cfg_of(ws, "pairs", "presharded"), tmp_path / "run", 2, ws[3])
    with pytest.raises(DataError, match=r"dataset\.pairs_as=chosen"):
        build_loaders(cfg_of(ws, "pairs", "presharded"), ws[3], 0, 1, tmp_path / "run", plan)


def test_a_refused_shard_keeps_the_quarantine_its_message_names(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [json.loads(x) for x in PAIRS.read_text().splitlines()[:4]])
    code, out = shard_cli(tmp_path / "shards", "--parts", "1", *data_args("pairs", path, "refuse"),
                          "dataset.bad_rows=skip", *COMMON, f"data.cache_dir={tmp_path / 'cache'}")
    named = re.search(r"see (\S+quarantine\.jsonl)", out)
    assert code == 2 and named and Path(named.group(1)).is_file(), out


# ---------------------------------------------------------------------------------------------------------------
# Real runs: 2 ranks under deepspeed (gloo), killed while saving step 4, resumed; then 1 rank in the same run dir


@pytest.mark.slow
@pytest.mark.parametrize("shape, kind", [("trl", "iterable"), ("pairs", "map"), ("pairs", "presharded")])
def test_two_rank_run_killed_resumed_and_resumed_on_one_rank(ws, tmp_path, shape, kind):
    from dsrecipes.commands.audit import main as audit_main
    from tests.faults import fault_env
    from tests.test_guarantees_e2e import raw_sessions
    from tests.test_train_runs import train_run

    root, files, expected, _, shards = ws
    argv = [*data_args(shape, files[shape]), "dataset.val_size=0", "dataset.max_samples=null", f"data={kind}",
            "data.num_workers=2", "trainer.micro_batch_size=2", "trainer.grad_accum=2", "trainer.max_steps=6",
            "trainer.save_every=2", "trainer.eval_every=0", "trainer.record_samples=true", "trainer.export=false",
            "data.shuffle=true"]
    if kind == "presharded":
        argv.append(f"data.shard_dir={shards[shape]}")
    run, _ = train_run(tmp_path, "run", *argv, env=fault_env(tmp_path, kill_before_latest=4), expect_ok=False)
    assert (run / "checkpoints" / "latest").read_text() == "step_2"
    _, out = train_run(tmp_path, "run", *argv)  # the same command: resume=auto
    assert "resumed from" in out and "step_2" in out, out[-3000:]
    with contextlib.redirect_stdout(io.StringIO()):
        assert audit_main(["--ledger", str(run)]) == 0
    epoch0 = []
    for r in range(2):
        killed, resumed = raw_sessions(run, r)
        assert [s for s in killed if s[1] > 2] == [s for s in resumed if s[1] <= 4]  # steps 3-4 replayed alike
        epoch0 += [i for e, step, ids in [x for x in killed if x[1] <= 2] + resumed if e == 0 for i in ids]
    assert sorted(epoch0) == sorted(expected[shape])  # 5 steps x 8: every sample of epoch 0 once
    # elastic: the same run directory on 1 rank, grad_accum 4 (the same global batch of 8), 3 more steps
    one = [*argv, "trainer.grad_accum=4", "trainer.max_steps=9"]
    if kind == "presharded":
        train_run(tmp_path, "run", *one, world_size=1, expect_ok=False)  # refused: 2 parts, 1 rank
        return
    train_run(tmp_path, "run", *one, world_size=1)
    with contextlib.redirect_stdout(io.StringIO()):
        assert audit_main(["--ledger", str(run)]) == 0
    last = raw_sessions(run, 0)[-1]
    assert sorted({step for _, step, _ in last}) == [7, 8, 9] and all(len(ids) == 2 for _, _, ids in last)
