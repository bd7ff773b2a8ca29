"""Training from an object store end to end (issue 23): a real `deepspeed --num_gpus 2` CPU run through
`python -m dsrecipes` whose `dataset.paths` are an `s3://` glob on a real S3-API server (moto's standalone server),
for `data=map` (prepared once, streaming, by the launching process). Checked with the sample ledgers: exactly once
per epoch, equal steps on every rank; the credentials appear nowhere in the run directory.

The store runs of `data=iterable` (readers read their own blocks with ranged GETs: the stream index names the
objects by ETag, the credentials nowhere in the run) and of `dsrecipes shard s3://... --out s3://...` followed by the
printed `data=presharded` command (each rank reads only its own part, straight from the store) are the runs of
tests/test_guarantees_e2e.py, which reads its data from the store so that one run serves both files' checks.

Refusals, in-process through `dsrecipes.cli.main` (what `python -m dsrecipes` calls) since they come before any rank
starts: a store that cannot be asked stops the run with one message, exit 2, before any rank starts; `shard` does not
write into a prefix holding someone else's object.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.s3server import SECRET
from tests.test_train_runs import SHORT, train_run

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
FILES = {"big.jsonl": 60, "mid.jsonl": 25, "tiny.jsonl": 7}
NUM_SAMPLES = sum(FILES.values())  # 92
RANKS, MICRO = 2, 4
GLOBAL_BATCH = RANKS * MICRO
COMMON = ("trainer.record_samples=true", "trainer.export=false", f"trainer.micro_batch_size={MICRO}",
          "trainer.grad_accum=1", "trainer.max_steps=null", "trainer.epochs=1", "trainer.save_every=100",
          "dataset.max_samples=null", "dataset.val_size=0", "trainer.eval_every=0",
          "dataset.paths=[s3://dsr-e2e/train/*.jsonl]")


@pytest.fixture(scope="module")
def corpus(s3_server, tmp_path_factory):
    from dsrecipes.data.sources.remote import s3

    fs = s3()
    fs.mkdir("s3://dsr-e2e")
    lines = [ln for ln in SAMPLE.read_text(encoding="utf-8").splitlines(keepends=True) if ln.strip()]
    ids, start = set(), 0
    for name, n in FILES.items():
        chunk = lines[start:start + n]
        start += n
        fs.pipe(f"s3://dsr-e2e/train/{name}", "".join(chunk).encode())
        for line_no, line in enumerate(chunk, 1):
            row = json.loads(line)
            ids.add(str(row["id"]) if row.get("id") else f"{name}:{line_no}")
    assert len(ids) == NUM_SAMPLES
    return tmp_path_factory.mktemp("store_e2e"), ids


def _check_run(run: Path, ids: set) -> None:
    from dsrecipes.data.plan.ledger import verify_ledgers

    plan = json.loads((run / "plan.json").read_text())
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == plan["total_steps"] == NUM_SAMPLES // GLOBAL_BATCH
    report = verify_ledgers(run, expected_ids=ids, global_batch=GLOBAL_BATCH, complete_epochs=[0])
    assert report.ok, report.summary()
    assert report.steps_per_rank == {r: plan["total_steps"] for r in range(RANKS)}
    for path in run.rglob("*"):  # config.yaml, plan.json, logs, ledgers, checkpoints' metadata
        if path.is_file() and path.stat().st_size < 50 << 20:
            assert SECRET.encode() not in path.read_bytes(), f"the secret key leaked into {path}"


def test_map_from_s3_two_ranks_exactly_once_equal_steps(corpus):
    root, ids = corpus
    run, out = train_run(root, "map", *COMMON, "data=map", env={"AWS_SECRET_ACCESS_KEY": SECRET})
    _check_run(run, ids)
    assert SECRET not in out


def test_shard_does_not_write_into_a_prefix_holding_someone_elses_object(corpus, capsys):
    """`dsrecipes shard s3://... --out s3://.../theirs` where theirs/ holds an object shard did not write: exit 2,
    one message, the object untouched (refused before anything is written, so in-process)."""
    from dsrecipes.cli import main as cli
    from dsrecipes.data.sources.remote import s3

    root, _ = corpus
    fs = s3()
    fs.pipe_file("s3://dsr-e2e/theirs/notes.txt", b"mine")
    training = [*SHORT, *COMMON[:-1], f"data.cache_dir={root / 'cache'}", f"trainer.output_dir={root / 'presharded'}"]
    code = cli(["shard", "s3://dsr-e2e/train/*.jsonl", "--parts", "2", "--out", "s3://dsr-e2e/theirs", *training])
    assert code == 2 and "holds 'notes.txt', which shard does not write" in capsys.readouterr().err
    assert fs.ls("s3://dsr-e2e/theirs") == ["dsr-e2e/theirs/notes.txt"]


@pytest.mark.parametrize("case,env,message", [
    ("no credentials", {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, "no credentials for the store"),
    ("no network", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "the store cannot be reached"),
    ("unknown bucket", {}, "s3://no-such-bucket/train/*.jsonl: not found in the store"),
])
def test_a_store_that_cannot_be_asked_is_one_message_exit_2_before_any_rank(corpus, case, env, message, monkeypatch,
                                                                           capfd):
    """In-process (`dsrecipes.cli.main`): the refusal comes from the launching process, before any rank; capfd also
    holds anything a launched child would have written."""
    from dsrecipes.cli import main as cli

    root, _ = corpus
    run = root / f"refused-{case.replace(' ', '-')}"
    for k, v in env.items():
        monkeypatch.delenv(k, raising=False) if v is None else monkeypatch.setenv(k, v)
    paths = "[s3://no-such-bucket/train/*.jsonl]" if case == "unknown bucket" else "[s3://dsr-e2e/train/*.jsonl]"
    argv = [*SHORT, *COMMON, f"dataset.paths={paths}", "data=iterable", f"data.cache_dir={root / 'cache'}",
            f"trainer.output_dir={run}", f"hydra.run.dir={run}", "launcher=deepspeed", f"launcher.num_gpus={RANKS}"]
    code = cli(argv)
    captured = capfd.readouterr()
    err = captured.out + captured.err
    assert code == 2, err[-3000:]
    assert message in err and "Traceback" not in err
    assert not (run / "plan.json").exists() and "rank 1" not in err.lower()
    assert SECRET not in err
