"""The malformed-input catalogue (tests/fixtures/data/malformed) through all three strategies under both policies.

map: `prepare()`; iterable: the pre-scan (`scan_stream`) and the loader workers' `RowEncoder`; presharded:
`dsrecipes shard` (`shard()`), whose parts a presharded run reads. Under `error` the first bad row is named as
`file:line` (or `file: element N (line L)`); under `skip` the counts per reason and per file are exact. Files that
break are refused under both policies. The end-to-end command lines (exit 2, no traceback) are in
test_malformed_e2e.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.core.paths import TINY_TOKENIZER_DIR
from dsrecipes.data.shard.build import read_manifest

CAT = Path(__file__).parent / "fixtures" / "data" / "malformed"
OLD = Path(__file__).parent / "fixtures" / "data" / "bad_rows.jsonl"
ROWS, ARRAY = str(CAT / "rows.jsonl"), str(CAT / "array.json")
ROWS_BAD = {"invalid_text": 2, "too_deep": 1, "too_large": 1}  # rows.jsonl: 13 rows, 9 good
ARRAY_BAD = {"invalid_json": 1, "not_an_object": 1, "invalid_text": 1, "too_large": 1}  # array.json: 6, 2 good
OLD_BAD = {"bad_value": 3, "conversation_not_list": 1, "empty_conversation": 1, "invalid_json": 1,
           "invalid_utf8": 1, "missing_conversation": 1, "no_assistant_turn": 1, "not_an_object": 1,
           "system_not_first": 1, "turn_not_object": 1, "unknown_role": 1}  # bad_rows.jsonl: 16 rows, 3 good
STRATEGIES = ("map", "iterable", "presharded")


@pytest.fixture(scope="module")
def refusing_tokenizer(tmp_path_factory) -> Path:
    """The tiny tokenizer with a chat_template that raises on the word REFUSE (as real templates raise on roles)."""
    out = tmp_path_factory.mktemp("refusing_tokenizer")
    for f in TINY_TOKENIZER_DIR.iterdir():
        shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{%- for m in messages -%}{%- if 'REFUSE' in m['content'] -%}"
                               "{{ raise_exception('this template refuses the row') }}{%- endif -%}{%- endfor -%}"
                               + config["chat_template"])
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def settings(tmp_path: Path, strategy: str, policy: str, *paths: str, extra=()) -> list:
    out = [f"dataset.paths=[{','.join(paths)}]", "dataset.max_row_bytes=4096", f"dataset.bad_rows={policy}",
           "dataset.max_bad_fraction=1.0", "dataset.val_size=0", f"data.cache_dir={tmp_path / 'cache'}",
           *extra]
    if strategy == "iterable":
        out += ["data=iterable", "trainer.max_steps=2", "scheduler.warmup_steps=0"]
    return out


def read_through(strategy: str, cfg, tmp_path: Path) -> dict:
    """What the strategy's launching-side reader makes of the data: {rows, good, bad: {reason: n}, by_file}."""
    run = tmp_path / "run"
    if strategy == "map":
        from dsrecipes.core.tokenizer import load_tokenizer
        from dsrecipes.data.prepare.build import prepare

        stats = prepare(cfg, load_tokenizer(cfg), run).stats
        return {"rows": stats["rows_read"], "good": stats["rows_kept"], "bad": stats["skipped"],
                "by_file": stats["skipped_by_file"]}
    if strategy == "iterable":
        from dsrecipes.data.stream.scan import scan_stream

        counts = scan_stream(cfg, run)
        entries = [json.loads(x) for x in (run / "quarantine.jsonl").read_text().splitlines()] if counts["skipped"] else []
        bad: dict = {}
        for e in entries:
            bad[e["reason"]] = bad.get(e["reason"], 0) + 1
        return {"rows": counts["rows"], "good": counts["good"], "bad": bad, "by_file": None}
    from dsrecipes.data.shard.build import shard

    m = shard(cfg, 1, str(tmp_path / "parts"), force=True)
    return {"rows": m.total + sum(m.bad_rows.values()), "good": m.total, "bad": m.bad_rows,
            "by_file": m.bad_rows_by_file}


def runtime_rows(cfg, tmp_path: Path, strategy: str):
    """The loader workers' side: RowEncoder over every block the stream index gives (iterable), or over the part's
    items (presharded)."""
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.plan.sampler import StreamSpec
    from dsrecipes.data.strategies.rows import RowEncoder

    if strategy == "iterable":
        from dsrecipes.data.strategies.iterable import stream_rows
        from dsrecipes.data.stream.index import BlockSource, build_stream_index

        index = build_stream_index(cfg)
        source = BlockSource(index, cfg.dataset.max_row_bytes)
        items = [(*row, 0) for g in range(index.blocks["count"].size) for row in source.block(g)]
        source.close()
        encoder = stream_rows(cfg, load_tokenizer(cfg), index)
        return encoder(items), encoder
    part = read_manifest(str(tmp_path / "parts")).part_path(0)
    stream = StreamSpec((part,), None, cfg.dataset.max_row_bytes)
    encoder = RowEncoder(cfg, load_tokenizer(cfg), stream.paths, [SourceConfig(name="part0")])
    return encoder(list(stream.items(0, cfg.trainer.seed, False))), encoder


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_skip_counts_every_kind_exactly(make_cfg, tmp_path, strategy):
    cfg = make_cfg(*settings(tmp_path, strategy, "skip", ROWS, str(OLD), ARRAY))
    got = read_through(strategy, cfg, tmp_path)
    want = dict(OLD_BAD)
    for extra in (ROWS_BAD, ARRAY_BAD):
        for k, v in extra.items():
            want[k] = want.get(k, 0) + v
    assert got["bad"] == dict(sorted(want.items()))
    assert got["good"] == 9 + 3 + 2
    assert got["rows"] == 13 + 16 + 6
    if got["by_file"] is not None:  # prepare_stats.json and the shard manifest list the bad rows of each file
        assert got["by_file"][ROWS] == dict(sorted(ROWS_BAD.items()))
        assert sum(got["by_file"][str(OLD)].values()) == 13
    if strategy != "map":  # the workers meet exactly the rows the launching side passed: nothing fails mid-run
        rows, encoder = runtime_rows(cfg, tmp_path, strategy)
        assert len(rows) == got["good"]
        assert encoder.skipped == (sum(want.values()) if strategy == "iterable" else 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_error_names_the_first_bad_row(make_cfg, tmp_path, strategy):
    cfg = make_cfg(*settings(tmp_path, strategy, "error", ROWS))
    with pytest.raises(DataError) as err:
        read_through(strategy, cfg, tmp_path)
    assert err.value.problems == [f"{ROWS}:2: invalid_text (a string holds a lone UTF-16 surrogate (an unpaired "
                                  "\\ud800-\\udfff escape)); set dataset.bad_rows=skip to quarantine bad rows"]
    if strategy == "iterable":  # a worker that met the row would stop with the same message
        with pytest.raises(DataError) as runtime:
            runtime_rows(cfg, tmp_path, strategy)
        assert runtime.value.problems == err.value.problems


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_json_array_elements_are_located_by_element_and_line(make_cfg, tmp_path, strategy):
    cfg = make_cfg(*settings(tmp_path, strategy, "error", ARRAY))
    with pytest.raises(DataError, match=r"array\.json: element 1 \(line 3\): invalid_json \(Expecting property"):
        read_through(strategy, cfg, tmp_path)
    cfg = make_cfg(*settings(tmp_path, strategy, "skip", ARRAY))
    read_through(strategy, cfg, tmp_path)
    quarantine = tmp_path / ("parts" if strategy == "presharded" else "run") / "quarantine.jsonl"
    entries = [json.loads(x) for x in quarantine.read_text().splitlines()]
    assert [(e["element"], e["line"], e["reason"]) for e in entries] == [
        (1, 3, "invalid_json"), (2, 4, "not_an_object"), (3, 5, "invalid_text"), (4, 8, "too_large")]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_max_bad_fraction_counts_every_array_element(make_cfg, tmp_path, strategy):
    """The bad elements of a JSON array count one by one toward dataset.max_bad_fraction (not as one bad file)."""
    cfg = make_cfg(*settings(tmp_path, strategy, "skip", ARRAY, extra=["dataset.max_bad_fraction=0.5"]))
    with pytest.raises(DataError, match=r"4 of 6 rows are bad \(66.7% > dataset.max_bad_fraction=0.5\)"):
        read_through(strategy, cfg, tmp_path)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rows_a_template_refuses_are_bad_rows_everywhere(make_cfg, tmp_path, strategy, refusing_tokenizer):
    """Rendering is part of the check: the scan and shard see the template_error a worker would otherwise hit."""
    extra = [f"model.tokenizer_path={refusing_tokenizer}", "template=tokenizer"]
    cfg = make_cfg(*settings(tmp_path, strategy, "skip", ROWS, extra=extra))
    got = read_through(strategy, cfg, tmp_path)
    assert got["bad"] == dict(sorted({**ROWS_BAD, "template_error": 1}.items())) and got["good"] == 8
    if strategy != "map":
        rows, encoder = runtime_rows(cfg, tmp_path, strategy)
        assert len(rows) == 8
    lines = [line for i, line in enumerate(Path(ROWS).read_text().splitlines(), 1) if i in (1, 3, 5)]
    (tmp_path / "three.jsonl").write_text("\n".join(lines) + "\n")
    cfg = make_cfg(*settings(tmp_path, strategy, "error", str(tmp_path / "three.jsonl"), extra=extra))
    with pytest.raises(DataError, match=r"three\.jsonl:3: template_error \(this template refuses the row\)"):
        read_through(strategy, cfg, tmp_path)


BROKEN = [  # (file, where reading stopped, what broke); a stream decompresses in larger pieces: it stops earlier
    ("truncated.jsonl.gz", "after line 263", "(truncated: Compressed file ended before the end-of-stream"),
    ("corrupt.jsonl.gz", "after line 50", "(corrupt compressed data: Error -3 while decompressing data"),
    ("not_gzip.jsonl.gz", "before its first line", "(not gzip-compressed, although its name ends in .gz)"),
    ("broken_array.json", "at line 4, after 2 rows", "(broken JSON: expected ',' or ']' after element 1"),
    ("unclosed_array.json", "at line 4, after 2 rows", "(broken JSON: the array is not closed"),
]


@pytest.mark.parametrize("policy", ["error", "skip"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name,where,what", BROKEN)
def test_broken_files_are_refused_under_both_policies(make_cfg, tmp_path, strategy, policy, name, where, what):
    path = str(CAT / name)
    cfg = make_cfg(*settings(tmp_path, strategy, policy, path, extra=["data.prescan=false"]))
    with pytest.raises(DataError) as err:  # a stream is indexed (and converted) even without its pre-scan
        read_through(strategy, cfg, tmp_path)
    (problem,) = err.value.problems
    exact = strategy != "iterable" or name.endswith(".json")
    assert problem.startswith(f"{path}: unreadable {where} {what}" if exact else f"{path}: unreadable "), problem
    assert what in problem and "refused under both dataset.bad_rows policies" in problem


def test_presharded_run_with_another_template_scans_its_parts(make_cfg, tmp_path, refusing_tokenizer):
    """Parts checked by `shard` with chatml hold the REFUSE row; a run rendering with a template that refuses it
    scans the parts before launch instead of failing mid-run."""
    from dsrecipes.data.shard.build import shard
    from dsrecipes.run.entry import plan_data

    shard(make_cfg(*settings(tmp_path, "map", "skip", ROWS)), 1, str(tmp_path / "parts"))
    part = read_manifest(str(tmp_path / "parts")).part_path(0)
    run = ["data=presharded", f"data.shard_dir={tmp_path / 'parts'}", "trainer.max_steps=2", "scheduler.warmup_steps=0"]
    fingerprint = read_manifest(str(tmp_path / "parts")).fingerprint
    assert plan_data(make_cfg(*run), tmp_path / "run", None, fingerprint, 1).rows == 9  # same template, tokenizer: no scan
    refusing = [f"model.tokenizer_path={refusing_tokenizer}", "template=tokenizer"]
    with pytest.raises(DataError, match=rf"{part}:3: template_error \(this template refuses the row\)"):
        plan_data(make_cfg(*run, *refusing), tmp_path / "run", None, fingerprint, 1)
