"""`data=iterable` at scale, end to end (issue 13): a real `deepspeed --num_gpus 2` CPU run through
`python -m dsrecipes` over a mix of a ShareGPT JSON array (weight 2) and a gzipped JSONL file (weight 0.5), with
`trainer.epochs` and no `data.num_samples`, a validation hold-out, and the sample ledger.

Checked: the launching process counts the epoch from its index and writes it into plan.json (`rows`,
`steps_per_epoch`), the ranks train exactly that, eval_loss appears, the ledger shows every sample at most once per
epoch with the JSON array's element positions as ids, the weight-2 repeats as `<id>@1`, the weight-0.5 source split
over the two epochs, and no held-out row is ever trained on.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.test_train_runs import train_run

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
N_ARRAY, N_GZ, VAL = 40, 24, 6
RANKS, MICRO, EPOCHS = 2, 4, 2


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream_e2e")
    rows = [json.loads(x) for x in SAMPLE.read_text(encoding="utf-8").splitlines()[:N_ARRAY + N_GZ]]
    for r in rows[:N_ARRAY]:
        r.pop("id", None)  # the array's ids are its element positions: chat.json:<index>
    (root / "chat.json").write_text(json.dumps(rows[:N_ARRAY], indent=2, ensure_ascii=False), encoding="utf-8")
    (root / "extra.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows[N_ARRAY:]).encode()))
    (root / "mix.yaml").write_text("chat: {paths: [chat.json], weight: 2.0}\nextra: {paths: [extra.jsonl.gz], "
                                   "weight: 0.5}\n", encoding="utf-8")
    run, _ = train_run(root, "run", "data=iterable", "dataset.paths=[]", f"dataset.registry={root / 'mix.yaml'}",
                       "dataset.use=[chat,extra]", f"dataset.val_size={VAL}", "dataset.max_samples=null",
                       "trainer.max_steps=null", f"trainer.epochs={EPOCHS}", f"trainer.micro_batch_size={MICRO}",
                       "trainer.record_samples=true", "trainer.export=false", "trainer.eval_every=10",
                       "data.num_workers=2", "data.shuffle_buffer=16")
    return root, run


def test_mixed_stream_epochs_eval_and_ledger(mixed_run):
    from dsrecipes.data.plan.ledger import read_ledger, verify_ledgers
    from dsrecipes.data.stream.index import read_stream_index

    root, run = mixed_run
    plan = json.loads((run / "plan.json").read_text())
    index = read_stream_index(run)
    held = index.holdout.tolist()
    kept_chat = N_ARRAY - sum(1 for n in held if n < N_ARRAY)
    kept_gz = N_GZ - sum(1 for n in held if n >= N_ARRAY)
    rows = 2 * kept_chat + round(0.5 * kept_gz)
    gb = RANKS * MICRO
    assert len(held) == VAL and plan["rows"] == rows
    assert plan["steps_per_epoch"] == rows // gb and plan["total_steps"] == EPOCHS * (rows // gb)
    converted = [Path(f.path).parent for f in index.files]
    assert converted == [root / "cache" / "stream"] * 2 and [f.loc_base for f in index.files] == [-1, 0]

    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == plan["total_steps"]
    assert result["final_eval_loss"] is not None
    assert any("eval_loss" in json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip())

    report = verify_ledgers(run, global_batch=gb, complete_epochs=range(EPOCHS))
    assert report.ok, report.summary()
    assert report.steps_per_rank == {r: plan["total_steps"] for r in range(RANKS)}
    per_epoch = {e: [] for e in range(EPOCHS)}
    for r in range(RANKS):
        for (epoch, _), ids in read_ledger(run / "ledger" / f"rank{r}.jsonl").items():
            per_epoch[epoch] += ids
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    val_ids = {f"chat.json:{n}" if n < N_ARRAY else json.loads(lines[n]).get("id") or f"extra.jsonl.gz:{n - N_ARRAY + 1}"
               for n in held}
    gz_seen = set()
    for epoch, ids in per_epoch.items():
        assert not set(ids) & val_ids, "a held-out validation row was trained on"
        chat = [i for i in ids if i.startswith("chat.json:")]
        assert len(set(chat)) == len(chat) and rows - len(ids) < gb
        assert Counter(i.split("@")[0] for i in chat).most_common(1)[0][1] == 2  # weight 2: two copies
        assert sum(i.endswith("@1") for i in chat) >= kept_chat - gb
        gz = [i for i in ids if not i.startswith("chat.json:")]
        assert abs(len(gz) - round(0.5 * kept_gz)) < gb
        gz_seen |= set(gz)
    assert len(gz_seen) >= kept_gz - gb  # weight 0.5: the two epochs read different halves
