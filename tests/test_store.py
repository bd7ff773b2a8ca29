"""Data in an object store (issue 23), against a real S3-API server (moto's standalone server, `s3_server`):
listing and globs, identity by ETag (no content read), ranged reads of exactly the blocks asked for, an object
replaced during a run refused, throttling and connections dropped mid-range survived (a real faulty proxy), the
one-pass indexing of the launching process, hf:// through the local Hub cache offline, and the validation messages
for a store that cannot be asked."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dsrecipes.errors import DataError

SAMPLE = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"


def lines(n: int, start: int = 0) -> list[str]:
    return SAMPLE.read_text(encoding="utf-8").splitlines()[start:start + n]


@pytest.fixture(scope="module")
def bucket(s3_server):
    """s3://dsr-data: two JSONL files, a gzipped JSONL, a JSON array."""
    from dsrecipes.data.remote import s3

    fs = s3()
    fs.mkdir("s3://dsr-data")
    fs.pipe("s3://dsr-data/chat/a.jsonl", ("\n".join(lines(30)) + "\n").encode())
    fs.pipe("s3://dsr-data/chat/b.jsonl", ("\n".join(lines(20, 30)) + "\n").encode())
    fs.pipe("s3://dsr-data/more/c.jsonl.gz", gzip.compress(("\n".join(lines(10, 50)) + "\n").encode()))
    rows = [json.loads(x) for x in lines(8, 60)]
    fs.pipe("s3://dsr-data/more/d.json", json.dumps(rows, indent=1).encode())
    return fs


def test_globs_list_sorted_objects_and_unknown_buckets_say_so(bucket):
    from dsrecipes.data.files import expand_paths

    files, missing = expand_paths(["s3://dsr-data/chat/*.jsonl", "s3://dsr-data/more/*", "s3://dsr-data/none/*.jsonl"])
    assert files == ["s3://dsr-data/chat/a.jsonl", "s3://dsr-data/chat/b.jsonl", "s3://dsr-data/more/c.jsonl.gz",
                     "s3://dsr-data/more/d.json"]
    assert missing == ["s3://dsr-data/none/*.jsonl"]
    with pytest.raises(DataError, match="s3://no-such-bucket/x/\\*.jsonl: not found in the store"):
        expand_paths(["s3://no-such-bucket/x/*.jsonl"])
    for bad, why in [("s3://key:secret@dsr-data/a.jsonl", "must not carry credentials"),
                     ("gs://dsr-data/a.jsonl", "scheme gs:// is not read")]:
        with pytest.raises(DataError, match=why):
            expand_paths([bad])


def test_rows_of_every_format_read_from_the_store_as_from_local_files(bucket, tmp_path):
    from dsrecipes.data.files import read_rows

    fs = bucket
    for url in ("s3://dsr-data/chat/a.jsonl", "s3://dsr-data/more/c.jsonl.gz", "s3://dsr-data/more/d.json"):
        local = tmp_path / url.rsplit("/", 1)[1]
        local.write_bytes(fs.cat_file(url))
        remote_rows = [(r.loc, r.element, r.value, r.error) for r in read_rows(url)]
        assert remote_rows == [(r.loc, r.element, r.value, r.error) for r in read_rows(str(local))]
        assert all(r[3] is None for r in remote_rows) and len(remote_rows) in (30, 10, 8)


def test_identity_is_the_etag_and_a_replaced_object_is_refused(bucket):
    from dsrecipes.data.remote import ObjectChanged, RangeReader, identity

    fs = bucket
    url = "s3://dsr-data/swap/x.jsonl"
    fs.pipe(url, b'{"a": 1}\n{"a": 2}\n')
    digest = identity(url)
    assert digest == identity(url) and digest.startswith("s3-")
    reader = RangeReader(url, digest)
    assert reader.read(9, 17) == b'{"a": 2}'
    fs.pipe(url, b'{"b": 1}\n{"b": 2}\n')  # same size, new content: a new ETag
    assert identity(url) != digest
    with pytest.raises(ObjectChanged, match="changed in the store since the launching process indexed it"):
        reader.read(0, 8)
    with pytest.raises(ObjectChanged):
        RangeReader(url, digest).read(0, 8)
