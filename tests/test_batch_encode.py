"""The parallel read -> check -> tokenize pipeline (data/render/batch_encode.py) against a plain sequential read.

Workers parse and check the rows and the launching process applies caps and the bad-row policy chunk by chunk; with
tiny chunks, caps falling mid-chunk, bad rows on both sides of chunk borders and a missing pattern, the result must
be what `iter_conversations` + `Encoder.encode_batch` give in one process, row for row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.core.paths import SAMPLE_DATA_DIR, TINY_TOKENIZER_DIR
from dsrecipes.core.schema import BadRows, DatasetConfig, SourceConfig, TemplateConfig, TemplateKind, TrainConfig
from dsrecipes.data.render import batch_encode
from dsrecipes.data.render.tokenize import Encoder
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.sharegpt import iter_conversations

FIX = Path(__file__).parent / "fixtures" / "data"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


def config(max_samples=None, policy=BadRows.skip, workers=2) -> TrainConfig:
    cfg = TrainConfig()
    cfg.template = TemplateConfig(name=TemplateKind.chatml)
    cfg.data.cutoff_len = 48  # truncation and "nothing trained left" drops happen too
    cfg.data.preprocess_workers = workers
    cfg.dataset = DatasetConfig(paths=[str(FIX / "bad_rows.jsonl")], bad_rows=policy, max_bad_fraction=1.0,
                                max_samples=max_samples)
    return cfg


def sources():
    return [
        SourceConfig(name="bad", paths=[str(FIX / "bad_rows.jsonl")]),
        SourceConfig(name="sample", paths=[str(SAMPLE_DATA_DIR / "train.jsonl")], max_samples=95),
        SourceConfig(name="gz", paths=[str(FIX / "nothing-*.jsonl"), str(FIX / "small.jsonl.gz")]),
        SourceConfig(name="arr", paths=[str(FIX / "array.json")]),
    ]


def sequential(cfg, tok, tmp_path):
    report = BadRowReport(cfg.dataset.bad_rows, 1.0, tmp_path / "seq.jsonl")
    convs = list(iter_conversations(cfg.dataset, report=report, sources=sources()))
    errors = []
    examples = Encoder(tok, cfg).encode_batch(convs, errors)
    for conv, bad in errors:
        report.add(conv.path, conv.loc, bad)
    report.close()
    return convs, examples, report


def quarantined(path: Path):
    return sorted((e["file"], e["line"], e["reason"]) for e in map(json.loads, path.read_text().splitlines()))


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("max_samples", [None, 60, 101])  # no cap; inside the sample source; inside gz
def test_parallel_chunks_equal_a_sequential_read(tok, tmp_path, monkeypatch, workers, max_samples):
    monkeypatch.setattr(batch_encode, "CHUNK", 7)
    cfg = config(max_samples, workers=workers)
    convs, examples, ref = sequential(cfg, tok, tmp_path)
    report = BadRowReport(cfg.dataset.bad_rows, 1.0, tmp_path / "par.jsonl")
    enc = batch_encode.read_and_encode(cfg, tok, sources(), report)
    report.close()
    assert enc.ids == [c.id for c in convs] and enc.sources == [c.source for c in convs]
    assert len(convs) == (max_samples or 104) and enc.sources.count("sample") == min(95, len(convs) - 3)
    assert (report.rows_read, report.counts, report.trailing_turns_dropped) == \
        (ref.rows_read, ref.counts, ref.trailing_turns_dropped)
    assert quarantined(tmp_path / "par.jsonl") == quarantined(tmp_path / "seq.jsonl")
    assert enc.lengths.tolist() == [0 if e is None else len(e.input_ids) for e in examples]
    assert enc.truncated.tolist() == [bool(e and e.truncated) for e in examples]
    assert enc.dropped == [i for i, e in enumerate(examples) if e is None] and enc.dropped  # drops were tested
    kept = [e for e in examples if e is not None]
    assert enc.input_ids.tolist() == [t for e in kept for t in e.input_ids]
    assert enc.labels.tolist() == [t for e in kept for t in e.labels]
    assert np.array_equal(enc.starts, np.concatenate([[0], np.cumsum(enc.lengths)[:-1]]))


def test_error_policy_stops_at_the_first_bad_row_in_file_order(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(batch_encode, "CHUNK", 3)
    cfg = config(policy=BadRows.error)
    with pytest.raises(DataError) as seq:
        sequential(cfg, tok, tmp_path)
    with pytest.raises(DataError) as par:
        batch_encode.read_and_encode(cfg, tok, sources(), BadRowReport(BadRows.error, 1.0))
    assert str(par.value) == str(seq.value) and "bad_rows.jsonl:2: invalid_json" in str(par.value)


# ----------------------------------------------------------------------------------------------------------------
# Issue 11's bounded reader behind the workers: the malformed catalogue, broken files, empty files


CAT = FIX / "malformed"


def catalogue_config(tmp_path, policy=BadRows.skip, workers=2, *names) -> TrainConfig:
    cfg = config(policy=policy, workers=workers)
    cfg.dataset.max_row_bytes = 4096
    (tmp_path / "empty.jsonl").write_text("\n\n")
    paths = [str(CAT / n) for n in names] or [str(CAT / "rows.jsonl"), str(tmp_path / "empty.jsonl"),
                                              str(CAT / "array.json"), str(FIX / "bad_rows.jsonl")]
    cfg.dataset.paths = paths
    return cfg


def catalogue_sources(cfg):
    return [SourceConfig(name="cat", paths=list(cfg.dataset.paths))]


def both_ways(cfg, tok, tmp_path):
    """(sequential, parallel): the report (or the DataError raised) of `iter_conversations` + `encode_batch` in one
    process, and of `read_and_encode`."""
    out = []
    for name in ("seq", "par"):
        report = BadRowReport(cfg.dataset.bad_rows, 1.0, tmp_path / f"{name}.jsonl")
        try:
            if name == "seq":
                convs = list(iter_conversations(cfg.dataset, report=report, sources=catalogue_sources(cfg)))
                errors: list = []
                Encoder(tok, cfg).encode_batch(convs, errors)
                for conv, bad in errors:
                    report.add(conv.path, conv.loc, bad, None, conv.element)
            else:
                batch_encode.read_and_encode(cfg, tok, catalogue_sources(cfg), report)
        except DataError as exc:
            out.append(str(exc))
            continue
        finally:
            report.close()
        entries = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        out.append((report.rows_read, dict(report.counts), report.files(),
                    sorted((e["file"], e["line"], e["element"], e["reason"]) for e in entries)))
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_catalogue_through_workers_equals_the_bounded_sequential_read(tok, tmp_path, monkeypatch, workers):
    monkeypatch.setattr(batch_encode, "CHUNK", 4)
    cfg = catalogue_config(tmp_path, BadRows.skip, workers)
    seq, par = both_ways(cfg, tok, tmp_path)
    assert par == seq
    counts = par[1]
    assert counts["too_large"] == 2 and counts["too_deep"] == 1 and counts["invalid_text"] == 3
    assert counts["empty_file"] == 1
    assert (str(CAT / "array.json"), 8, 4, "too_large") in par[3]  # element 4, line 8


@pytest.mark.parametrize("policy", [BadRows.skip, BadRows.error])
@pytest.mark.parametrize("name", ["truncated.jsonl.gz", "corrupt.jsonl.gz", "not_gzip.jsonl.gz", "broken_array.json",
                                  "unclosed_array.json"])
def test_a_broken_file_is_refused_in_its_place(tok, tmp_path, monkeypatch, policy, name):
    """FileUnreadable under both policies, after the rows before it (rows.jsonl's first bad row wins under error)."""
    monkeypatch.setattr(batch_encode, "CHUNK", 16)
    from dsrecipes.data.sources.files import FileUnreadable

    for first in ([name], ["rows.jsonl", name]):
        cfg = catalogue_config(tmp_path, policy, 2, *first)
        seq, par = both_ways(cfg, tok, tmp_path)
        assert par == seq
        if policy is BadRows.skip or len(first) == 1:
            assert par.startswith(f"{CAT / name}: unreadable ")
        else:
            assert par.startswith(f"{CAT / 'rows.jsonl'}:2: invalid_text")
    cfg = catalogue_config(tmp_path, policy, 2, name)
    with pytest.raises(FileUnreadable):
        batch_encode.read_and_encode(cfg, tok, catalogue_sources(cfg), BadRowReport(policy, 1.0))


def test_a_broken_file_past_the_cap_is_not_reached(tok, tmp_path):
    cfg = catalogue_config(tmp_path, BadRows.skip, 2, "rows.jsonl", "truncated.jsonl.gz")
    cfg.dataset.max_samples = 5
    enc = batch_encode.read_and_encode(cfg, tok, catalogue_sources(cfg), BadRowReport(BadRows.skip, 1.0))
    assert len(enc.ids) == 5
