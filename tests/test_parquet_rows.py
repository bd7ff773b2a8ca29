"""Parquet files are read by data=map (and `dsrecipes shard`) row by row: row N is line N of a JSON-lines file, so
the same rows as Parquet and as JSON lines prepare the same token ids and labels, a bad row is `file:N`, a column JSON
cannot carry is one message naming file, row and column, a broken file one message naming it, hf:// and s3:// files
are read too, and data=iterable (an index of byte offsets of lines) refuses Parquet naming data=map. Before, every
Parquet file was refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.core.paths import SAMPLE_DATA_DIR

SAMPLE = [json.loads(line) for line in (SAMPLE_DATA_DIR / "train.jsonl").read_text().splitlines()[:40]]


def sharegpt_rows() -> List[dict]:
    """Sample conversations with a `system` column on some rows, `tools` (text) on others, an id on some."""
    rows = []
    for i, row in enumerate(SAMPLE):
        row = dict(row)
        if i % 3 == 0:
            row["system"] = f"You are assistant number {i}."
        if i % 4 == 1:
            row["tools"] = json.dumps([{"name": "calc", "description": "adds"}])
        rows.append(row)
    return rows


def write_both(folder: Path, name: str, rows: List[dict], table=None) -> tuple:
    """(parquet, jsonl): the same rows as a Parquet file (several row groups) and as JSON lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist takes the first row's keys only
    table = pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]) if table is None else table
    pq.write_table(table, folder / f"{name}.parquet", row_group_size=7)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                                                  for r in rows))
    return folder / f"{name}.parquet", folder / f"{name}.jsonl"


def prepared_rows(make_cfg, tmp_path: Path, tag: str, *overrides: str) -> list:
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    cfg = make_cfg("debug=fast", "dataset.val_size=0", f"data.cache_dir={tmp_path / 'cache'}", *overrides)
    table = prepare(cfg, load_tokenizer(cfg), tmp_path / f"run-{tag}").train.table
    ids = [[i.replace(".parquet:", ":").replace(".jsonl:", ":") for i in row] for row in table.column("ids").to_pylist()]
    return list(zip(ids, table.column("input_ids").to_pylist(), table.column("labels").to_pylist()))


def test_parquet_rows_prepare_as_their_json_lines(make_cfg, tmp_path, monkeypatch):
    import dsrecipes.data.sources.parquet_rows as parquet_rows

    monkeypatch.setattr(parquet_rows, "BATCH_ROWS", 5)  # batches cross row groups (7 rows each)
    pq_path, jl_path = write_both(tmp_path / "data", "train", sharegpt_rows())
    from_parquet = prepared_rows(make_cfg, tmp_path, "pq", f"dataset.paths=[{pq_path}]")
    from_jsonl = prepared_rows(make_cfg, tmp_path, "jl", f"dataset.paths=[{jl_path}]")
    assert len(from_parquet) == len(SAMPLE) and from_parquet == from_jsonl
    assert any(i[0].startswith("train:") for i, _, _ in from_parquet)  # default ids: `<file name>:N`, N the row


def test_alpaca_columns_of_dataset_info_and_preference_pairs_read_as_json_rows(make_cfg, tmp_path):
    """LLaMA-Factory entries over Parquet: alpaca through `columns` (beside an image column no reader looks at, whose
    bytes JSON could not carry), and a ranking entry's chosen/rejected structs."""
    import pyarrow as pa

    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.preference import pair_of as check_pair
    from dsrecipes.data.sources.registry import resolve_sources
    from dsrecipes.data.sources.sharegpt import iter_checked

    data = tmp_path / "data"
    alpaca = [{"q": f"Add {i} and {i + 1}.", "ctx": "" if i % 2 else "Show the sum.", "a": f"{2 * i + 1}",
               "sys": "Be brief." if i % 3 == 0 else None} for i in range(12)]
    table = pa.Table.from_pylist(alpaca).append_column("image", pa.array([b"\x89PNG"] * 12, pa.binary()))
    write_both(data, "alpaca", alpaca, table)
    pairs = [json.loads(line) for line in (SAMPLE_DATA_DIR / "pairs.jsonl").read_text().splitlines()[:15]]
    write_both(data, "pairs", pairs)
    lf = {"columns": {"prompt": "q", "query": "ctx", "response": "a", "system": "sys"}, "formatting": "alpaca"}
    ranking = {"formatting": "sharegpt", "ranking": True}
    (data / "dataset_info.json").write_text(json.dumps(
        {f"{name}_{ext}": {**entry, "file_name": f"{name}.{ext}"} for name, entry in (("alpaca", lf), ("pairs", ranking))
         for ext in ("parquet", "jsonl")}))
    registry = f"dataset.registry={data / 'dataset_info.json'}"
    rows = {ext: prepared_rows(make_cfg, tmp_path, ext, registry, f"dataset.use=[alpaca_{ext}]")
            for ext in ("parquet", "jsonl")}
    assert len(rows["parquet"]) == 12 and rows["parquet"] == rows["jsonl"]

    def read_pairs(ext: str) -> list:
        cfg = make_cfg("debug=fast", registry, f"dataset.use=[pairs_{ext}]")
        (source,) = resolve_sources(cfg.dataset)
        report = BadRowReport(cfg.dataset.bad_rows, 1.0)
        return [(p.prompt.turns, p.prompt.system, p.chosen, p.rejected, p.prompt.id.split(":")[-1])
                for p in iter_checked(source, report, None, cfg.dataset.max_row_bytes, check_pair)]

    from_parquet = read_pairs("parquet")
    assert len(from_parquet) == 15 and from_parquet == read_pairs("jsonl")


def test_a_real_run_on_parquet_takes_the_first_step_of_its_json_lines(tmp_path, capsys):
    from dsrecipes.cli import main

    pq_path, jl_path = write_both(tmp_path / "data", "train", sharegpt_rows())
    losses = []
    for path in (pq_path, jl_path):
        run = tmp_path / path.suffix[1:]
        assert main(["train", "debug=fast", f"dataset.paths=[{path}]", "trainer.max_steps=2", "trainer.log_every=1",
                     f"trainer.output_dir={run}", f"data.cache_dir={tmp_path / 'cache'}"]) == 0, capsys.readouterr().err
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses.append([m["loss"] for m in metrics if "loss" in m])
        assert json.loads((run / "prepare_stats.json").read_text())["rows_read"] == len(SAMPLE)
    assert losses[0] and losses[0] == losses[1]


def test_a_bad_parquet_row_is_file_colon_row(make_cfg, tmp_path):
    rows = sharegpt_rows()
    rows[2] = {**rows[2], "conversations": [{"from": "wizard", "value": "hi"}, {"from": "gpt", "value": "ho"}]}
    pq_path, _ = write_both(tmp_path / "data", "train", rows)
    with pytest.raises(DataError) as err:
        prepared_rows(make_cfg, tmp_path, "error", f"dataset.paths=[{pq_path}]", "dataset.bad_rows=error")
    (problem,) = err.value.problems
    assert problem.startswith(f"{pq_path}:3: unknown_role (turn 0: from='wizard')"), problem
    kept = prepared_rows(make_cfg, tmp_path, "skip", f"dataset.paths=[{pq_path}]", "dataset.bad_rows=skip",
                         "dataset.max_bad_fraction=0.5")
    assert len(kept) == len(rows) - 1
    (entry,) = [json.loads(x) for x in (tmp_path / "run-skip" / "quarantine.jsonl").read_text().splitlines()]
    assert (entry["file"], entry["line"], entry["reason"]) == (str(pq_path), 3, "unknown_role")


def one_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    return err


def test_a_used_column_json_cannot_carry_is_one_message_naming_file_row_and_column(tmp_path, capsys):
    import datetime

    import pyarrow as pa

    from dsrecipes.cli import main

    rows = sharegpt_rows()[:6]
    table = pa.Table.from_pylist([{k: v for k, v in r.items() if k != "system"} for r in rows])
    stamps = [None, datetime.datetime(2024, 1, 1)] + [None] * 4
    table = table.append_column("system", pa.array(stamps, pa.timestamp("s")))
    pq_path, _ = write_both(tmp_path / "data", "train", rows, table)
    assert main(["train", "debug=fast", f"dataset.paths=[{pq_path}]", f"trainer.output_dir={tmp_path / 'run'}",
                 f"data.cache_dir={tmp_path / 'cache'}"]) == 2
    one_error(capsys, f"{pq_path}:2: column 'system' holds datetime values", "(Parquet type timestamp[")


def test_a_broken_parquet_file_is_one_message_naming_it(tmp_path, capsys):
    from dsrecipes.cli import main

    pq_path, _ = write_both(tmp_path / "data", "train", sharegpt_rows())
    whole = pq_path.read_bytes()
    for cut in (whole[: len(whole) // 2], whole[:4] + b"\0" * (len(whole) - 4)):  # truncated; no footer
        pq_path.write_bytes(cut)
        assert main(["train", "debug=fast", f"dataset.paths=[{pq_path}]", f"trainer.output_dir={tmp_path / 'run'}",
                     f"data.cache_dir={tmp_path / 'cache'}"]) == 2
        one_error(capsys, f"{pq_path}: unreadable before its first row (not a readable Parquet file")


def test_data_iterable_refuses_parquet_naming_data_map(make_cfg, tmp_path, capsys):
    from dsrecipes.cli import main
    from tests.test_data_malformed import read_through, settings

    pq_path, _ = write_both(tmp_path / "data", "train", sharegpt_rows())
    assert main(["validate", "debug=fast", "data=iterable", f"dataset.paths=[{pq_path}]"]) == 2
    one_error(capsys, f"{pq_path}: a Parquet file", "data=map", "dsrecipes shard", "python -c")
    cfg = make_cfg(*settings(tmp_path, "iterable", "skip", str(pq_path)), check_files=False)
    with pytest.raises(DataError) as err:  # the stream's index itself, past validate
        read_through("iterable", cfg, tmp_path)
    (problem,) = err.value.problems
    assert problem.startswith(f"{pq_path}: a Parquet file") and "data=map" in problem, problem
    assert main(["validate", "debug=fast", f"dataset.paths=[{pq_path}]"]) == 0  # data=map reads it


def test_a_hub_parquet_file_is_read_from_the_local_hub_cache(make_cfg, tmp_path, monkeypatch):
    """hf://datasets/... names local files of the Hub cache (offline here): Parquet, as the Hub serves datasets."""
    from tests.test_store import _hub_dataset

    pq_path, jl_path = write_both(tmp_path / "data", "train", sharegpt_rows())
    _hub_dataset(tmp_path / "hf", "acme/chats", {"data/train-00000-of-00001.parquet": pq_path.read_bytes()})
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from_hub = prepared_rows(make_cfg, tmp_path, "hub", "dataset.paths=[hf://datasets/acme/chats/data/*.parquet]")
    from_jsonl = prepared_rows(make_cfg, tmp_path, "jl", f"dataset.paths=[{jl_path}]")
    assert len(from_hub) == len(SAMPLE)
    assert [([i.replace("train-00000-of-00001:", "train:") for i in ids], x, y) for ids, x, y in from_hub] == from_jsonl


def test_a_parquet_object_in_a_store_is_read_through_its_seekable_reader(make_cfg, tmp_path, s3_server):
    from dsrecipes.data.sources.remote import s3

    pq_path, jl_path = write_both(tmp_path / "data", "train", sharegpt_rows())
    fs = s3()
    fs.mkdir("s3://dsr-parquet")
    fs.pipe("s3://dsr-parquet/data/train.parquet", pq_path.read_bytes())
    from_store = prepared_rows(make_cfg, tmp_path, "s3", "dataset.paths=[s3://dsr-parquet/data/*.parquet]")
    assert len(from_store) == len(SAMPLE) and from_store == prepared_rows(make_cfg, tmp_path, "jl",
                                                                           f"dataset.paths=[{jl_path}]")


def test_a_large_row_group_is_not_held_in_memory_while_its_rows_are_read(tmp_path):
    """Was: pq.ParquetFile read a row group's column chunks ahead whole (pyarrow's default pre_buffer), so memory held
    a row group compressed while its rows were read: pd.to_parquet writes up to a million rows in one (a 110 MiB row
    group of conversations: arrow memory peaked at 121 MiB). Now chunks are read through a 1 MiB buffer: after the
    first row of a 23 MiB row group, arrow holds 4 MiB (the first batch), where it held 26."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dsrecipes.data.sources.parquet_rows import parquet_items

    rows = [{"conversations": [{"from": "human", "value": os.urandom(512).hex()}]} for _ in range(24000)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "one_group.parquet", row_group_size=len(rows))
    items = parquet_items(str(tmp_path / "one_group.parquet"), 1 << 20)
    before = pa.total_allocated_bytes()
    first = next(items)
    held = pa.total_allocated_bytes() - before
    assert json.loads(first[1]) == rows[0]
    assert held < 12 << 20, f"{held >> 20} MiB held after the first row of a 23 MiB row group"
    assert sum(1 for _ in items) == len(rows) - 1


def test_a_parquet_row_is_the_json_text_of_its_columns_in_every_batch(tmp_path):
    """The row bytes are json.dumps(row, ensure_ascii=False) (what dataset.max_row_bytes measures and the quarantine
    keeps) in batches of plain ASCII (made by the faster ASCII encoder), with DEL, non-ASCII text or names, control
    characters, backslashes, and null struct fields left out (only where a batch has one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dsrecipes.data.sources import parquet_rows

    values = ['a"b\\c\n\t\x01', "plain", "q\\u00e9", "del\x7f", "snow\u2603", "\U0001F600", ""]
    rows = []
    for i in range(3 * parquet_rows.BATCH_ROWS):
        turn = {"from": "human", "value": values[i % 3] if i < 2000 else values[i % len(values)]}
        if i == 2500:
            turn["weight"] = 1.0  # every other turn's weight is null: left out
        rows.append({"conversations": [turn], "n": i, "f": i / 7})
    rows.append({"conversations": [{"fróm": "x"}]})  # a non-ASCII name
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet", row_group_size=1500)
    got = [data for _, data, _, _ in parquet_rows.parquet_items(str(tmp_path / "rows.parquet"), 1 << 20)]
    assert got == [json.dumps(r, ensure_ascii=False).encode() for r in rows]
