"""Training from an object store end to end (issue 23): real `deepspeed --num_gpus 2` CPU runs through
`python -m dsrecipes` whose `dataset.paths` are `s3://` globs on a real S3-API server (moto's standalone server),
for `data=iterable` (readers read their own blocks with ranged GETs) and `data=map` (prepared once, streaming, by the
launching process). Checked with the sample ledgers: exactly once per epoch, equal steps on every rank; the
credentials appear nowhere in the run directory; a store that cannot be asked stops the run with one message,
exit 2, before any rank starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env
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
    from dsrecipes.data.ledger import verify_ledgers

    plan = json.loads((run / "plan.json").read_text())
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == plan["total_steps"] == NUM_SAMPLES // GLOBAL_BATCH
    report = verify_ledgers(run, expected_ids=ids, global_batch=GLOBAL_BATCH, complete_epochs=[0])
    assert report.ok, report.summary()
    assert report.steps_per_rank == {r: plan["total_steps"] for r in range(RANKS)}
    for path in run.rglob("*"):  # config.yaml, plan.json, logs, ledgers, checkpoints' metadata
        if path.is_file() and path.stat().st_size < 50 << 20:
            assert SECRET.encode() not in path.read_bytes(), f"the secret key leaked into {path}"


def test_iterable_from_s3_two_ranks_exactly_once_equal_steps(corpus):
    from dsrecipes.data.stream.index import read_stream_index

    root, ids = corpus
    run, out = train_run(root, "iterable", *COMMON, "data=iterable", "data.num_workers=2", "data.shuffle_buffer=16",
                         env={"AWS_SECRET_ACCESS_KEY": SECRET})
    _check_run(run, ids)
    index = read_stream_index(run)
    assert [f.path for f in index.files] == [f"s3://dsr-e2e/train/{n}" for n in sorted(FILES)]
    assert all(f.digest.startswith("s3-") for f in index.files)  # identity = ETag, the contents were not hashed
    assert SECRET not in out


def test_map_from_s3_two_ranks_exactly_once_equal_steps(corpus):
    root, ids = corpus
    run, out = train_run(root, "map", *COMMON, "data=map", env={"AWS_SECRET_ACCESS_KEY": SECRET})
    _check_run(run, ids)
    assert SECRET not in out


def test_shard_into_the_store_then_presharded_ranks_read_only_their_part(corpus):
    """`dsrecipes shard s3://... --out s3://.../parts2`, then the printed training command: each rank reads only
    its own part, straight from the store, exactly once."""
    from dsrecipes.data.ledger import read_ledger, verify_ledgers
    from dsrecipes.data.sources.remote import s3

    root, ids = corpus
    out_url = "s3://dsr-e2e/parts2"
    training = [*SHORT, *COMMON[:-1], f"data.cache_dir={root / 'cache'}", f"trainer.output_dir={root / 'presharded'}"]
    argv = [sys.executable, "-m", "dsrecipes", "shard", "s3://dsr-e2e/train/*.jsonl", "--parts", "2", "--out", out_url,
            *training]
    proc = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("train with: ")]
    command = line[len("train with: "):]
    assert f"data.shard_dir={out_url} " in command
    fs = s3()
    manifest = json.loads(fs.cat_file(f"{out_url}/manifest.json"))
    parts = [[json.loads(t)["id"] for t in fs.cat_file(f"{out_url}/{name}").decode().splitlines() if t.strip()]
             for name in manifest["files"]]
    assert len(manifest["identities"]) == 2 and set(parts[0]) | set(parts[1]) == ids
    assert not list((root / "cache").glob("shard-staging-*")), "the staging directory is removed"
    env = subprocess_env({"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    proc = subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    run = root / "presharded"
    report = verify_ledgers(run, ids, GLOBAL_BATCH)
    assert report.ok, report.summary()
    for r in range(RANKS):
        read = [i for batch in read_ledger(run / "ledger" / f"rank{r}.jsonl").values() for i in batch]
        assert read and set(read) <= set(parts[r]) and len(read) == len(set(read))
    # a prefix holding someone else's object is not written into
    fs.pipe_file("s3://dsr-e2e/theirs/notes.txt", b"mine")
    argv[argv.index(out_url)] = "s3://dsr-e2e/theirs"
    proc = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "holds 'notes.txt', which shard does not write" in proc.stderr
    assert fs.ls("s3://dsr-e2e/theirs") == ["dsr-e2e/theirs/notes.txt"]


@pytest.mark.parametrize("case,env,message", [
    ("no credentials", {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, "no credentials for the store"),
    ("no network", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "the store cannot be reached"),
    ("unknown bucket", {}, "s3://no-such-bucket/train/*.jsonl: not found in the store"),
])
def test_a_store_that_cannot_be_asked_is_one_message_exit_2_before_any_rank(corpus, case, env, message):
    root, _ = corpus
    run = root / f"refused-{case.replace(' ', '-')}"
    full = subprocess_env()
    for k, v in env.items():
        full.pop(k, None) if v is None else full.__setitem__(k, v)
    paths = "[s3://no-such-bucket/train/*.jsonl]" if case == "unknown bucket" else "[s3://dsr-e2e/train/*.jsonl]"
    argv = [sys.executable, "-m", "dsrecipes", *SHORT, *COMMON, f"dataset.paths={paths}", "data=iterable",
            f"data.cache_dir={root / 'cache'}", f"trainer.output_dir={run}", f"hydra.run.dir={run}",
            "launcher=deepspeed", f"launcher.num_gpus={RANKS}"]
    proc = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=300)
    err = proc.stdout + proc.stderr
    assert proc.returncode == 2, err[-3000:]
    assert message in err and "Traceback" not in err
    assert not (run / "plan.json").exists() and "rank 1" not in err.lower()
    assert os.environ.get("AWS_SECRET_ACCESS_KEY", "") not in err or not os.environ.get("AWS_SECRET_ACCESS_KEY")
