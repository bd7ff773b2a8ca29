"""Reading rows with bounded memory (data/sources/files.py, data/sources/jsonscan.py), one read per real file, the cache key's file
hashes, and the encoder's per-row failures and long-text heads (data/render/tokenize.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from dsrecipes.data.sources import files, jsonscan
from dsrecipes.data.sources.badrows import BadReason
from dsrecipes.data.sources.files import parse_row, read_rows
from tests.conftest import subprocess_env

GOOD = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_array_values_survive_every_chunk_boundary(monkeypatch, chunk):
    monkeypatch.setattr(jsonscan, "CHUNK", chunk)
    items = [GOOD, {"s": 'quote \" and ] } [ { \\ end'}, [1, [2, {"a": []}]], "text", 12.5e3, True, None, {}]
    text = "[\n" + ",\n  ".join(json.dumps(x, indent=1 if i == 2 else None) for i, x in enumerate(items)) + "\n]\n"
    got = list(jsonscan.values(io.BytesIO(text.encode()), 1 << 20))
    assert [json.loads(v.data) for v in got] == items
    starts = [text.count("\n", 0, text.index(json.dumps(x, indent=1 if i == 2 else None))) + 1
              for i, x in enumerate(items)]
    assert [v.line for v in got] == starts and [v.element for v in got] == list(range(len(items)))


def test_json_file_of_lines_or_one_object(tmp_path):
    (tmp_path / "lines.json").write_text(json.dumps(GOOD) + "\n\n" + json.dumps(GOOD, indent=2) + "\n")
    rows = list(read_rows(str(tmp_path / "lines.json")))
    assert [(r.loc, r.element, r.error) for r in rows] == [(1, None, None), (3, None, None)]
    assert rows[1].default_id == "lines.json:3" and rows[1].where.endswith("lines.json:3")
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    assert next(read_rows(str(tmp_path / "bom.jsonl"))).error is None  # a byte-order mark is not a bad row


def test_a_huge_line_is_skipped_in_pieces(tmp_path):
    path = tmp_path / "huge.jsonl"
    big = json.dumps({"conversations": [{"from": "human", "value": "x" * 20_000_000}]})
    path.write_text(json.dumps(GOOD) + "\n" + big + "\n" + json.dumps(GOOD) + "\n")
    tracemalloc.start()
    rows = list(read_rows(str(path), limit=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [(r.loc, r.error.reason if r.error else None) for r in rows] == [(1, None), (2, BadReason.too_large), (3, None)]
    assert peak < 4 << 20, f"{peak} bytes held to skip a 20 MB row"


def test_a_huge_array_element_is_skipped_in_pieces(tmp_path):
    path = tmp_path / "huge.json"
    big = json.dumps({"conversations": [{"from": "human", "value": "x\\\"" * 5_000_000}]})
    path.write_text(f"[{json.dumps(GOOD)},\n{big},\n{json.dumps(GOOD)}]")
    tracemalloc.start()
    rows = list(read_rows(str(path), limit=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [(r.element, r.loc, r.error.reason if r.error else None) for r in rows] == [
        (0, 1, None), (1, 2, BadReason.too_large), (2, 3, None)]
    assert peak < 8 << 20, f"{peak} bytes held to skip a 25 MB element"


def test_parse_row_kinds(monkeypatch):
    pair = b'{"a": "\\ud83d\\ude00"}'
    assert parse_row("f", 1, pair).value == {"a": "\U0001F600"}  # an escaped surrogate pair is text
    assert parse_row("f", 1, b'{"\\udc00": 1}').error.reason is BadReason.invalid_text  # in a key too
    assert parse_row("f", 1, b'["\\uDBFF"]').error.reason is BadReason.invalid_text
    assert parse_row("f", 1, b"[" * 101 + b"]" * 101).error.reason is BadReason.too_deep
    assert parse_row("f", 1, b"[" * 100 + b"]" * 100).error is None
    assert parse_row("f", 1, b'{"v": "' + b"[" * 500 + b'"}').error is None  # brackets inside strings do not nest
    monkeypatch.setattr(files, "MAX_DEPTH", 10**9)  # the parser's own recursion limit is caught as well
    deep = parse_row("f", 7, b"[" * 100_000 + b"]" * 100_000, 3)
    assert deep.error.reason is BadReason.too_deep and deep.where == "f: element 3 (line 7)"
    assert parse_row("f", 1, b'\xef\xbb\xbf{"a": 1}').value == {"a": 1}  # a file's BOM (the stream's first line)
    assert parse_row("f", 2, b'\xef\xbb\xbf{"a": 1}').error.reason is BadReason.invalid_json
    huge = parse_row("f", 2, b'{"n": 1' + b"0" * 5000 + b"}")  # valid JSON; Python refuses the int (ValueError)
    assert huge.error.reason is BadReason.invalid_json and "5001 digits" in huge.error.detail


def test_tool_call_arguments_that_python_cannot_parse_stay_text():
    """A tool call's `arguments` string is parsed for the template; a 5000-digit number or deep nesting in it
    (valid JSON, but ValueError/RecursionError in Python) keeps it as text instead of escaping the row checks."""
    from dsrecipes.core.schema import ColumnsConfig, DatasetFormat, SourceConfig
    from dsrecipes.data.sources.sharegpt import conversation_of, role_table

    src = SourceConfig(name="s", format=DatasetFormat.openai,
                       columns=ColumnsConfig(messages="messages", role="role", content="content"))
    for args in ('{"a": 1' + "0" * 5000 + "}", "[" * 100_000 + "]" * 100_000):
        row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": args}}]}, {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "done"}]}
        conv = conversation_of(parse_row("f", 1, json.dumps(row).encode()), src, role_table(src))
        assert json.loads(conv.turns[1].content) == {"name": "f", "arguments": args}


def test_one_file_is_read_once_under_every_spelling(make_cfg, tok, tmp_path, monkeypatch, capsys):
    from dsrecipes.data.prepare.build import prepare

    data = tmp_path / "d" / "rows.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({**GOOD, "id": f"r{i}"}) + "\n" for i in range(12)))
    (tmp_path / "link.jsonl").symlink_to(data)
    (tmp_path / "e").mkdir()
    monkeypatch.chdir(tmp_path / "e")
    spellings = [str(data), "../d/rows.jsonl", "./../d/rows.jsonl", str(tmp_path / "link.jsonl"), "../d/*.jsonl"]
    cfg = make_cfg(f"dataset.paths=[{','.join(spellings[:3])}]",
                   f"dataset.sources=[{{name: again, paths: [{spellings[3]}, '{spellings[4]}']}}]",
                   "dataset.val_size=4", f"data.cache_dir={tmp_path / 'cache'}")
    stats = prepare(cfg, tok, tmp_path / "run").stats
    assert stats["rows_read"] == 12 and stats["samples"] == {"train": 8, "val": 4}
    notes = [line for line in capsys.readouterr().err.splitlines() if "is the same file as" in line]
    assert len(notes) == 4 and all(n.endswith("it is read once") for n in notes)


def test_cache_key_sees_a_same_size_edit_with_the_mtime_set_back(make_cfg, tok, tmp_path, monkeypatch):
    from dsrecipes.data.prepare import cache
    from dsrecipes.data.prepare.build import prepare

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({**GOOD, "id": f"r{i}"}) + "\n" for i in range(10)))
    cfg = make_cfg(f"dataset.paths=[{path}]", "dataset.val_size=0", f"data.cache_dir={tmp_path / 'cache'}")

    def edit_keeping_size_and_mtime():
        st = os.stat(path)
        path.write_text(path.read_text().replace('"a"', '"b"', 1))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns

    first = prepare(cfg, tok, tmp_path / "run1").stats
    edit_keeping_size_and_mtime()  # right after hashing: the racy case, where even ctime may not have moved
    second = prepare(cfg, tok, tmp_path / "run2").stats
    assert second["cache_key"] != first["cache_key"] and not second["cache_hit"]

    memo: dict = {}
    monkeypatch.setattr(cache, "RACY_SECONDS", float("-inf"))  # as if the file were old
    before = cache.file_hash(str(path), memo)
    assert len(memo) == 1  # memoised
    assert cache.file_hash(str(path), memo) == before
    time.sleep(0.05)  # past the change-time granularity of the file system
    edit_keeping_size_and_mtime()
    assert cache.file_hash(str(path), memo) != before


@pytest.mark.parametrize("full_text", [True, False])
def test_a_text_the_tokenizer_refuses_is_one_bad_row(tok, full_text):
    """Both tokenization paths: a refused one-text batch is retried conversation by conversation, the refused
    conversation goes per segment, where the refused text is found; the rest of the batch is encoded."""
    from dsrecipes.core.schema import TrainConfig
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

    def poison(real):
        def encode(texts, **kw):
            if any("POISON" in t for t in texts):
                raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
            return real(texts, **kw)
        return encode

    class PoisonedTokenizer:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            attr = getattr(self.real, name)
            return poison(attr) if name.startswith("encode_batch") else attr

    enc = Encoder(tok, TrainConfig(), full_text=full_text)
    enc._encode_fast = poison(enc._encode_fast)
    if full_text:
        enc._full._tok = PoisonedTokenizer(enc._full._tok)
    convs = [Conversation(str(i), [Turn(Role.user, q), Turn(Role.assistant, "a")]) for i, q in
             enumerate(["fine", "POISON", "also fine"])]
    errors: list = []
    out = enc.encode_batch(convs, errors)
    assert [e is not None for e in out] == [True, False, True]
    assert [(c.id, b.reason) for c, b in errors] == [("1", BadReason.tokenizer_error)]
    batch = enc.encode_arrays(convs)
    assert [i for i, _ in batch.bad] == [1] and batch.per_segment == (1 if full_text else 0)


@pytest.mark.parametrize("cutoff", [16, 200])
def test_long_texts_give_exactly_the_head_full_tokenization_gives(tok, cutoff):
    import random

    from dsrecipes.core.schema import TrainConfig
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

    rng = random.Random(0)
    words = ["lorem", "ipsum", "法国", "的", "  ", "\n", "123", "!!", "ü", "😀", "a" * 30]
    texts = ["".join(rng.choice(words) + rng.choice([" ", ""]) for _ in range(6000)), "a" * 20000, " " * 9000 + "x"]
    cfg = TrainConfig()
    cfg.data.cutoff_len = cutoff
    enc, full = Encoder(tok, cfg), Encoder(tok, cfg)
    full.long_text = 10**12
    for text in texts:
        for turns in ([Turn(Role.user, text), Turn(Role.assistant, "a")], [Turn(Role.user, "q"), Turn(Role.assistant, text)]):
            a, b = enc.encode(Conversation("x", turns)), full.encode(Conversation("x", turns))
            assert (a is None) == (b is None)
            assert a is None or (a.input_ids, a.labels, a.truncated) == (b.input_ids, b.labels, b.truncated)


def test_a_16mb_row_costs_a_small_multiple_of_its_size():
    """Peak memory of rendering and tokenizing one 16 MiB row (the default dataset.max_row_bytes), in a fresh
    process: before, tokenizing it whole took ~2.5 GB (a 50 MB row took 15 GB)."""
    code = """
import resource, sys
from transformers import AutoTokenizer
from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.sources.files import parse_row
from dsrecipes.data.sources.sharegpt import conversation_of, role_table
from dsrecipes.core.schema import SourceConfig
from dsrecipes.data.render.tokenize import Encoder
from dsrecipes.core.paths import TINY_TOKENIZER_DIR
enc = Encoder(AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR)), TrainConfig())
enc.encode_texts(["warm up"])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
text = ("lorem ipsum dolor sit amet consectetur " * 500000)[:16 * 1024 * 1024 - 100]
raw = ('{"conversations": [{"from": "human", "value": "' + text + '"}, {"from": "gpt", "value": "ok"}]}').encode()
del text
src = SourceConfig(name="s")
conv = conversation_of(parse_row("f", 1, raw), src, role_table(src))
example = enc.encode(conv)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base, len(raw))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    grown_kib, size = map(int, out.stdout.split())
    assert grown_kib * 1024 < 8 * size, f"peak grew by {grown_kib} KiB for a row of {size} bytes"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))


def test_unreadable_file_message_names_file_and_progress(tmp_path):
    import gzip

    path = tmp_path / "x.jsonl.gz"
    whole = gzip.compress(("".join(json.dumps({**GOOD, "n": i, "pad": os.urandom(30).hex()}) + "\n"
                                   for i in range(300))).encode())
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(files.FileUnreadable) as err:
        list(read_rows(str(path)))
    assert str(err.value).startswith(f"{path}: unreadable after line ") and "truncated" in str(err.value)
    assert Path(str(path)).name in err.value.problems[0]


def test_a_listed_file_is_opened_once_to_be_read_not_sniffed_again(tmp_path, monkeypatch):
    """Was: files._items asked formats.other_format (an open and a read of the first bytes) of every file it read,
    although expand_paths had sniffed it when it listed it: 3 opens per file (100 local files: 300). Now the
    reader's own first bytes say whether it is Parquet: 2 opens (1 sniff when listed, 1 read), and a Parquet file
    under another name, an empty file and a broken .gz are still told apart as before."""
    import builtins
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from dsrecipes.data.sources.files import expand_paths

    (tmp_path / "a.jsonl").write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode()))
    opened, real_open = [], builtins.open

    def counted(name, *args, **kwargs):
        opened.append(str(name))
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counted)
    for name in ("a.jsonl", "b.jsonl.gz"):
        opened.clear()
        listed, _ = expand_paths([str(tmp_path / name)])
        assert [r.value for f in listed for r in read_rows(f)] == [GOOD]
        assert opened == [str(tmp_path / name)] * 2, opened
    monkeypatch.setattr(builtins, "open", real_open)
    pq.write_table(pa.Table.from_pylist([GOOD]), tmp_path / "c.jsonl")  # Parquet bytes under a JSON-lines name
    assert [r.value for r in read_rows(str(tmp_path / "c.jsonl"))] == [GOOD]
    (tmp_path / "d.jsonl").write_bytes(b"")
    assert [r.error.reason for r in read_rows(str(tmp_path / "d.jsonl"))] == [BadReason.empty_file]
    (tmp_path / "e.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(files.FileUnreadable, match="not gzip-compressed"):
        list(read_rows(str(tmp_path / "e.jsonl.gz")))
