"""A preparation worker (data.preprocess_workers > 1) that dies - the out-of-memory killer's SIGKILL - ends the
preparation within seconds with one message naming the setting, the worker and its signal, and leaves no worker
behind. Before (multiprocessing.Pool): the dead worker's chunk was never answered and the launching process waited
for it for ever, in silence."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from dsrecipes.core.errors import UserError
from dsrecipes.core.paths import SAMPLE_DATA_DIR, TINY_TOKENIZER_DIR
from dsrecipes.core.schema import DatasetConfig, SourceConfig, TemplateConfig, TemplateKind, TrainConfig
from dsrecipes.core.worker_pool import WorkerLost
from dsrecipes.data.render import batch_encode, prep_pool
from dsrecipes.data.sources.badrows import BadRowReport
from tests.fault_cases import outcome_within

_real_encode_chunk = batch_encode._encode_chunk
TEST_PROCESS = os.getpid()  # the faults below act in the preparation workers only


def _dies_on_its_third_chunk(task):
    """What the OOM killer does to a worker mid-preparation (runs in the worker: forked after the patch)."""
    _dies_on_its_third_chunk.calls = getattr(_dies_on_its_third_chunk, "calls", 0) + 1
    if _dies_on_its_third_chunk.calls == 3 and os.getpid() != TEST_PROCESS:  # never the test's own process
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_encode_chunk(task)


def _prepare_in_two_workers(tmp_path, monkeypatch, encode_chunk, bound_s):
    """The sample file prepared by 2 workers in chunks of 4 rows, `encode_chunk` in the workers: (outcome, s)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))
    monkeypatch.setattr(batch_encode, "CHUNK", 4)
    monkeypatch.setattr(batch_encode, "_encode_chunk", encode_chunk)
    cfg = TrainConfig()
    cfg.template = TemplateConfig(name=TemplateKind.chatml)
    cfg.data.preprocess_workers = 2
    source = SourceConfig(name="sample", paths=[str(SAMPLE_DATA_DIR / "train.jsonl")])
    cfg.dataset = DatasetConfig(paths=list(source.paths))
    report = BadRowReport(cfg.dataset.bad_rows, 1.0, tmp_path / "bad.jsonl")
    return outcome_within(lambda: batch_encode.read_and_encode(cfg, tok, [source], report), bound_s)


def test_a_killed_preparation_worker_ends_the_preparation(tmp_path, monkeypatch):
    before = {c.pid for c in psutil.Process().children()}
    outcome, took = _prepare_in_two_workers(tmp_path, monkeypatch, _dies_on_its_third_chunk, 20)
    assert took < 10, took  # (old code: still waiting for the dead worker's chunk after 20 s)
    assert isinstance(outcome, UserError), outcome
    message = str(outcome)
    assert message.startswith("data.preprocess_workers=2: a preparation worker process ended without an answer (pid")
    assert "killed by SIGKILL" in message and "lower data.preprocess_workers" in message
    left = [c for c in psutil.Process().children() if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, left


def test_a_refused_row_still_lets_running_chunks_finish(tmp_path):
    """bad_rows=error while chunks are in flight: one DataError, no worker left (the path the Pool's close+join
    served before)."""
    from transformers import AutoTokenizer

    from dsrecipes.core.errors import DataError
    from dsrecipes.core.schema import BadRows

    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))
    bad = tmp_path / "bad.jsonl"
    good = (SAMPLE_DATA_DIR / "train.jsonl").read_text().splitlines()
    bad.write_text("\n".join(good[:20] + ["{not json"] + good[20:]) + "\n")
    cfg = TrainConfig()
    cfg.template = TemplateConfig(name=TemplateKind.chatml)
    cfg.data.preprocess_workers = 2
    source = SourceConfig(name="bad", paths=[str(bad)])
    cfg.dataset = DatasetConfig(paths=[str(bad)], bad_rows=BadRows.error)
    before = {c.pid for c in psutil.Process().children()}
    with pytest.raises(DataError):
        batch_encode.read_and_encode(cfg, tok, [source], BadRowReport(BadRows.error, 1.0, tmp_path / "q.jsonl"))
    left = [c for c in psutil.Process().children() if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, left


def test_the_message_names_the_dead_worker_and_how_it_ended_where_known():
    """The pool reads the dead worker's exit status (it waits for it: tests/test_worker_pool.py) and names that
    worker, not a sibling: no executor ends the others with SIGTERM first any more."""
    message = prep_pool.lost_message(WorkerLost([(12, -signal.SIGKILL)], [], None), 2)
    assert "(pid 12, killed by SIGKILL)" in message, message
    message = prep_pool.lost_message(WorkerLost([(13, None)], [], None), 2)  # a status never readable: without it
    assert message.startswith("data.preprocess_workers=2: a preparation worker process ended without an answer;")


def _stuck_deaf_on_its_second_chunk(task):
    """A worker stuck in C on its second chunk: SIGTERM has no effect (its Python handler never runs). It ends by
    itself after 30 s, so that the old code's wait does not outlive the test."""
    _stuck_deaf_on_its_second_chunk.calls = getattr(_stuck_deaf_on_its_second_chunk, "calls", 0) + 1
    if _stuck_deaf_on_its_second_chunk.calls == 2 and os.getpid() != TEST_PROCESS:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        import time

        time.sleep(30)
        os._exit(0)
    return _real_encode_chunk(task)


def test_a_stuck_preparation_worker_is_named_while_awaited_then_ends_the_preparation(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(prep_pool, "WAIT_LINE_S", 0.5)
    monkeypatch.setattr(prep_pool, "CHUNK_TIMEOUT_S", 2.0)
    monkeypatch.setattr(prep_pool, "REAP_S", 1.0)
    before = {c.pid for c in psutil.Process().children()}
    outcome, took = _prepare_in_two_workers(tmp_path, monkeypatch, _stuck_deaf_on_its_second_chunk, 25)
    assert took < 12, took  # (old code: result() without a bound, then shutdown joined the deaf worker)
    assert isinstance(outcome, UserError), outcome
    assert str(outcome).startswith("data.preprocess_workers=2: no preparation worker answered for 2 s on a chunk of "
                                   "4 rows of "), outcome
    err = capsys.readouterr().err
    assert "preparing data: waiting " in err and " s for a chunk of 4 rows of " in err, err
    left = [c for c in psutil.Process().children() if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, left
