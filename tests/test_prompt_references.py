"""objective=grpo with rewards that compare each completion with its row's reference answer (exact_match,
number_equal): prompt rows without one are said (every completion of such a row scores 0 there), and a dataset with
no reference at all under such rewards only is refused before training (nothing could ever score, so nothing would
be learnt: a run that did not train). Was: silent (TRL users with a `ground_truth` column trained on all-zero
rewards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError

GRPO = ["objective=grpo", "data.cutoff_len=48", "objective.max_completion_length=6", "objective.num_generations=2",
        "dataset.val_size=0"]


def prompts(path: Path, n: int, with_reference: int) -> Path:
    rows = [{"conversations": [{"from": "human", "value": f"{i}+1="}], **({"reference": i + 1} if i < with_reference
                                                                        else {"ground_truth": i + 1})}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepare(tmp_path: Path, data: Path, *overrides: str):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare as build

    cfg = compose_and_load([*GRPO, f"dataset.paths=[{data}]", f"data.cache_dir={tmp_path / 'cache'}", *overrides])
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return build(cfg, load_tokenizer(cfg), run)


def test_no_reference_under_comparing_rewards_only_is_refused_naming_the_key(tmp_path):
    data = prompts(tmp_path / "p.jsonl", 6, 0)
    with pytest.raises(DataError, match=r"objective.rewards: 6 of 6 prompt rows have no reference answer .* "
                                        r"exact_match, number_equal compare the completion with it"):
        prepare(tmp_path, data, "objective.rewards=[{name: exact_match}, {name: number_equal}]")
    assert not (tmp_path / "run" / "prepare_stats.json").exists()  # nothing written for the run


def test_missing_references_are_said_and_other_rewards_keep_the_run(tmp_path, capsys):
    data = prompts(tmp_path / "p.jsonl", 6, 4)
    prepare(tmp_path, data, "objective.rewards=[{name: exact_match}]")
    assert "note: 2 of 6 prompt rows have no reference answer" in capsys.readouterr().err
    none = prompts(tmp_path / "none.jsonl", 6, 0)  # a reward that needs no reference: trains, and says so
    prepare(tmp_path, none, "objective.rewards=[{name: exact_match}, {name: length, max_chars: 4}]")
    assert "note: 6 of 6 prompt rows have no reference answer" in capsys.readouterr().err
    prepare(tmp_path, none, "objective.rewards=[{name: length, max_chars: 4}]")  # nothing compares: nothing said
    assert "reference answer" not in capsys.readouterr().err


def scan(tmp_path: Path, data: Path, *overrides: str):
    """data=iterable's launch-time pre-scan (stream/scan.py), which reads every row once before training."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.stream.scan import prepare_stream

    cfg = compose_and_load([*GRPO, "data=iterable", f"dataset.paths=[{data}]", f"data.cache_dir={tmp_path / 'cache'}",
                            *overrides])
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return prepare_stream(cfg, run)


def test_a_stream_says_and_refuses_as_a_preparation_does(tmp_path, capsys):
    """data=iterable (the pre-scan, cold and from its scan cache): the same note and the same refusal as data=map.
    Was: a streamed prompt set was silent (no prepared count)."""
    for _ in range(2):  # cold, then the scan cache's record
        with pytest.raises(DataError, match=r"objective.rewards: 6 of 6 prompt rows have no reference answer"):
            scan(tmp_path, prompts(tmp_path / "none.jsonl", 6, 0), "objective.rewards=[{name: exact_match}]")
    some = prompts(tmp_path / "some.jsonl", 6, 4)
    for _ in range(2):
        scan(tmp_path, some, "objective.rewards=[{name: exact_match}]")
        assert "note: 2 of 6 prompt rows have no reference answer" in capsys.readouterr().err
    scan(tmp_path, some, "objective.rewards=[{name: exact_match}]", "dataset.max_samples=4")  # the cap: all have one
    assert "reference answer" not in capsys.readouterr().err
    scan(tmp_path, prompts(tmp_path / "all.jsonl", 6, 6), "objective.rewards=[{name: exact_match}]")
    assert "reference answer" not in capsys.readouterr().err


def test_a_stream_without_references_is_one_message_exit_2(tmp_path):
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    data = prompts(tmp_path / "none.jsonl", 6, 0)
    out = subprocess.run([sys.executable, "-m", "dsrecipes", "train", *GRPO, "data=iterable", f"dataset.paths=[{data}]",
                          "objective.rewards=[{name: number_equal}]", f"data.cache_dir={tmp_path / 'cache'}",
                          f"trainer.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=tmp_path,
                         env=subprocess_env(), timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: objective.rewards: 6 of 6 prompt rows have no reference answer" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def presharded(tmp_path: Path, data: Path, name: str, *overrides: str, val_size: float = 0):
    """`dsrecipes shard` of `data`, then data=presharded's launch-time preparation of it (strategies/presharded.py)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.shard.build import shard
    from dsrecipes.data.strategies.presharded import PreshardedStrategy

    base = [*GRPO, f"data.cache_dir={tmp_path / 'cache'}"]
    manifest = shard(compose_and_load([*base, f"dataset.paths=[{data}]"]), 2, str(tmp_path / name), val_size=val_size)
    cfg = compose_and_load([*base, "data=presharded", f"data.shard_dir={tmp_path / name}", *overrides])
    run = tmp_path / f"run-{name}"
    run.mkdir(exist_ok=True)
    PreshardedStrategy().prepare(cfg, run, None, 2)
    return manifest


def test_a_shard_counts_its_training_rows_without_reference_and_the_run_says_it(tmp_path, capsys):
    """`dsrecipes shard` records the training parts' prompt rows without a reference (manifest `no_reference`; the
    validation part's left out); data=presharded then says them, or refuses a run that could never score, as map
    and iterable do. Was: presharded was silent."""
    none = presharded(tmp_path, prompts(tmp_path / "none.jsonl", 6, 0), "none", "objective.rewards=[{name: length}]")
    assert none.no_reference == 6 and "note: 6 of 6 prompt rows have no reference answer" not in capsys.readouterr().err
    with pytest.raises(DataError, match=r"objective.rewards: 6 of 6 prompt rows have no reference answer"):
        presharded(tmp_path, prompts(tmp_path / "none.jsonl", 6, 0), "none2", "objective.rewards=[{name: exact_match}]")
    some = presharded(tmp_path, prompts(tmp_path / "some.jsonl", 8, 4), "some",
                      "objective.rewards=[{name: exact_match}, {name: length}]", val_size=2)
    kept = [json.loads(x) for p in some.files for x in (tmp_path / "some" / p).read_text().splitlines()]
    assert some.no_reference == sum(1 for r in kept if r.get("reference") is None) and some.total == 6
    assert f"note: {some.no_reference} of 6 prompt rows have no reference answer" in capsys.readouterr().err


def test_a_manifest_with_a_forged_no_reference_is_refused(tmp_path):
    from dsrecipes.data.shard.manifest import read_manifest

    presharded(tmp_path, prompts(tmp_path / "p.jsonl", 4, 4), "s", "objective.rewards=[{name: exact_match}]")
    path = tmp_path / "s" / "manifest.json"
    for forged in (-1, 99, "3", 1.5):
        data = json.loads(path.read_text())
        data["no_reference"] = forged
        path.write_text(json.dumps(data))
        with pytest.raises(DataError, match="no_reference: .* is not a whole number of rows"):
            read_manifest(str(tmp_path / "s"))
