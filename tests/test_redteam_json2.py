"""JSON that someone else may have written, read through core/fileio's bounded reader (read_json_file /
loads_bounded) at every site a command reaches: a file of 100000 '[' (json's RecursionError), one over the size bound
or a FIFO where the file belongs is one message naming the file (exit 2), or the site's own fallback (a cache entry is
rebuilt), never a traceback or a wait for ever."""

import os
from pathlib import Path

import pytest

DEEP = "[" * 100000


def one_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err and "RecursionError" not in err, err
    for w in words:
        assert w in err, err
    return err


def test_shard_out_holding_a_deep_manifest_is_not_ours(tmp_path, capsys):
    # Was: build._json_or_none caught OSError/ValueError only: `dsrecipes shard --out DIR` over a DIR whose
    # manifest.json is 100000 '[' ended in json's RecursionError traceback.
    from dsrecipes.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(DEEP, encoding="utf-8")
    assert main(["shard", "--parts", "1", "--out", str(out), "debug=fast"]) == 2
    one_error(capsys, f"--out: {out} is not empty", "manifest.json")
    assert sorted(os.listdir(out)) == ["manifest.json"]  # nothing written into someone else's directory


@pytest.mark.parametrize("kind", ["deep", "large"])
def test_presharded_manifest_deep_or_too_large_is_one_message(kind, tmp_path, capsys):
    # Was: manifest.read_manifest json.loads'd data.shard_dir/manifest.json whole: 100000 '[' was a RecursionError
    # traceback at validate (and train); a file of any size was read into memory.
    from dsrecipes.cli import main

    shards = tmp_path / "shards"
    shards.mkdir()
    manifest = shards / "manifest.json"
    if kind == "deep":
        manifest.write_text(DEEP, encoding="utf-8")
    else:
        with open(manifest, "wb") as fh:  # sparse: 65 MiB of '{' then zero bytes, never read whole
            fh.write(b"{")
            fh.truncate(65 << 20)
    assert main(["validate", "debug=fast", "data=presharded", f"data.shard_dir={shards}"]) == 2
    why = "JSON nested too deeply" if kind == "deep" else "larger than 67108864 bytes"
    one_error(capsys, f"{manifest}: not a manifest written by `dsrecipes shard` ({why})")


def test_a_store_manifest_nested_too_deeply_is_not_json(monkeypatch):
    # Was: store.json_or_none caught ValueError only: a RecursionError from an object store's manifest.json.
    import dsrecipes.data.shard.store as store

    monkeypatch.setattr(store, "read_text", lambda url: DEEP)
    assert store.json_or_none("s3://bucket/shards/manifest.json") is None
