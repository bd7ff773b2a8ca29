"""JSON that someone else may have written, read through core/fileio's bounded reader (read_json_file /
loads_bounded) at every site a command reaches: a file of 100000 '[' (json's RecursionError), one over the size bound
or a FIFO where the file belongs is one message naming the file (exit 2), or the site's own fallback (a cache entry is
rebuilt), never a traceback or a wait for ever."""

import os

import pytest

from tests.test_point_of_use import signed_tag
from tests.test_trust import key_file  # noqa: F401  (fixture)

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


# --- a cache (data.cache_dir may be shared): a damaged entry is built again, or refused naming the file -----------


@pytest.mark.timeout(20)  # the FIFO blocked the read for ever before
@pytest.mark.parametrize("kind", ["deep", "fifo", "list"])
def test_a_hostile_memo_of_hashes_is_hashed_again(kind, tmp_path, capsys):
    # Was: cache._read_memo json.loads'd data.cache_dir/file_hashes.json: 100000 '[' ended `dsrecipes audit` (and
    # train, inspect-data) in a RecursionError traceback, a FIFO there blocked them for ever, a list was used as a dict.
    import json

    from dsrecipes.cli import main

    cache = tmp_path / "cache"
    cache.mkdir()
    memo = cache / "file_hashes.json"
    if kind == "fifo":
        os.mkfifo(memo)
    else:
        memo.write_text(DEEP if kind == "deep" else "[1, 2]", encoding="utf-8")
    assert main(["audit", "debug=fast", "data=iterable", f"data.cache_dir={cache}"]) == 0, capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err
    assert memo.is_file() and isinstance(json.loads(memo.read_text(encoding="utf-8")), dict)  # hashed again


def test_a_stream_index_whose_meta_is_nested_too_deeply_is_indexed_again(tmp_path, capsys):
    # Was: stream/files._load json.loads'd the index's meta (an .npz in data.cache_dir/stream): a RecursionError
    # traceback at `dsrecipes audit data=iterable` (train too), not a cache miss.
    import numpy as np

    from dsrecipes.cli import main

    cache = tmp_path / "cache"
    argv = ["audit", "debug=fast", "data=iterable", f"data.cache_dir={cache}"]
    assert main(argv) == 0
    index = next((cache / "stream").glob("*.npz"))
    with np.load(index) as z:
        arrays = {k: z[k] for k in z.files}
    index.unlink()
    with open(index, "wb") as fh:
        np.savez(fh, **{**arrays, "meta": np.array(DEEP)})
    capsys.readouterr()
    assert main(argv) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.timeout(20)  # the FIFO blocked the read for ever before
@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_a_hostile_cache_content_record_is_one_message(kind, tmp_path):
    # Was: cache_contents.check json.loads'd prepared/KEY/contents.json: 100000 '[' ended `dsrecipes inspect-data`
    # (and train) on a cache hit in a RecursionError traceback (tried), a FIFO blocked it for ever (tried).
    from dsrecipes.core.errors import DataError
    from dsrecipes.data.prepare.cache_contents import CONTENTS, check

    record = tmp_path / CONTENTS
    if kind == "fifo":
        os.mkfifo(record)
    else:
        record.write_text(DEEP, encoding="utf-8")
    with pytest.raises(DataError) as err:
        check(tmp_path)
    why = "JSON nested too deeply" if kind == "deep" else "not a regular file"
    assert str(err.value).startswith(f"{record}: no readable content record of this cache ({why}); delete ")


def test_kept_scans_and_prepared_split_states_nested_too_deeply_are_made_again(tmp_path):
    # Was: stream/scan_files.load_scan and arrow_rows' state.json caught ValueError, not json's RecursionError.
    from dsrecipes.core.errors import DataError
    from dsrecipes.data.prepare.arrow_rows import ArrowRows
    from dsrecipes.data.stream.scan_files import load_scan

    (tmp_path / "scan.json").write_text(DEEP, encoding="utf-8")
    assert load_scan(tmp_path / "scan.json") is None
    (tmp_path / "state.json").write_text(DEEP, encoding="utf-8")
    with pytest.raises(DataError, match="not a readable prepared split .JSON nested too deeply.; prepare the data"):
        ArrowRows.open(tmp_path)


# --- a model or tokenizer directory (anyone's): JSON transformers parses is read bounded first ----------------------


@pytest.mark.parametrize("name", ["special_tokens_map.json", "added_tokens.json"])
def test_validate_names_a_tokenizer_json_nested_too_deeply(name, tmp_path, capsys):
    # Was: validate said OK (tokenizer_files.open_tokenizer swallowed the RecursionError, no bounded read of these
    # files), then train / inspect-data refused the tokenizer as 'does not load as a tokenizer: maximum recursion
    # depth exceeded' (transformers' own json parse) and chat's load ended in that RecursionError.
    import shutil

    from dsrecipes.cli import main
    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    tok = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER_DIR, tok)
    (tok / name).write_text(DEEP, encoding="utf-8")
    assert main(["validate", "debug=fast", f"model.tokenizer_path={tok}"]) == 2
    one_error(capsys, f"model.tokenizer_path: {tok / name}: JSON nested too deeply")



# --- a checkpoint's complete.json swapped after the launching process checked it (a shared or foreign checkpoint) ----


def _swap_record(tag, kind):
    record = tag / "complete.json"
    record.unlink()
    if kind == "fifo":
        os.mkfifo(record)
    else:
        record.write_text(DEEP, encoding="utf-8")
    return record


@pytest.mark.timeout(20)  # the FIFO blocked the rank's open for ever before
@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_a_rank_refuses_a_record_swapped_for_a_hostile_one(kind, key_file, tmp_path):  # noqa: F811
    # Was: point_of_use.CheckedCheckpoint.add (each rank, and export) opened complete.json without O_NONBLOCK and
    # json.loads'd it whole: a FIFO swapped in after the launching process pinned the record blocked every rank for
    # ever, 100000 '[' was a RecursionError traceback in every rank instead of ChangedCheckpoint.
    from dsrecipes.boundary.point_of_use import ChangedCheckpoint, CheckedCheckpoint, read_pinned

    tag = signed_tag(tmp_path)
    pinned = read_pinned(tag)
    record = _swap_record(tag, kind)
    why = "JSON nested too deeply" if kind == "deep" else "not a regular file"
    with pytest.raises(ChangedCheckpoint, match=f"^{record}: unreadable when loading \\({why}\\); nothing was loaded"):
        CheckedCheckpoint.open(tag, pinned)


@pytest.mark.timeout(20)  # the FIFO blocked the launching process for ever before
@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_plan_resume_refuses_a_record_swapped_after_it_was_found(kind, key_file, tmp_path, monkeypatch):  # noqa: F811
    # Was: checkpoint_find.plan_resume read complete.json again (to pin it) with read_bytes + json.loads after
    # find_resume_checkpoint had verified it: swapped in between, a FIFO blocked `dsrecipes train` for ever and
    # 100000 '[' was a RecursionError traceback (the except named ValueError, not RecursionError).
    import dsrecipes.boundary.checkpoint_find as checkpoint_find
    from dsrecipes.core.errors import Refused

    tag = signed_tag(tmp_path)
    monkeypatch.setattr(checkpoint_find, "find_resume_checkpoint", lambda *a: _swap_record(tag, kind).parent)
    with pytest.raises(Refused, match="complete.json: changed while the run was planned"):
        checkpoint_find.plan_resume(None, tmp_path, 1, 0)


def test_export_out_holding_a_deep_marker_is_not_replaced(tmp_path, capsys):
    # Was: core/export_dir._written_by_export json.loads'd --out/dsrecipes_export.json (checked before the run is
    # read): `dsrecipes export RUN --out DIR` over a DIR whose marker is 100000 '[' ended in a RecursionError traceback.
    from dsrecipes.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "dsrecipes_export.json").write_text(DEEP, encoding="utf-8")
    (out / "config.json").write_text("{}", encoding="utf-8")
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 2
    one_error(capsys, f"{out} holds an unreadable dsrecipes_export.json; replacing it would delete them")
    assert sorted(os.listdir(out)) == ["config.json", "dsrecipes_export.json"]


def test_estimate_names_a_model_config_nested_too_deeply(tmp_path, capsys):
    # Was: run/estimate.read_hf_config json.loads'd config.json: `dsrecipes estimate --hf-config FILE` (or
    # model.path=DIR) with 100000 '[' ended in a RecursionError traceback.
    from dsrecipes.cli import main

    (tmp_path / "config.json").write_text(DEEP, encoding="utf-8")
    assert main(["estimate", "--hf-config", str(tmp_path / "config.json"), "debug=fast"]) == 2
    one_error(capsys, f"{tmp_path / 'config.json'} is unreadable (JSON nested too deeply")


@pytest.mark.timeout(20)  # the FIFO blocked the launching process for ever before
@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_a_resumed_runs_hostile_result_reads_as_not_finished(kind, make_cfg, tmp_path):
    # Was: run/entry.check_budget json.loads'd result.json of the resumed checkpoint's run directory (another user's
    # run under --trust-checkpoint): 100000 '[' was a RecursionError traceback at `dsrecipes train
    # trainer.resume_from=RUN`, a FIFO there blocked it for ever.
    from dsrecipes.core.runplan import ResumePlan
    from dsrecipes.run.entry import check_budget

    tag = tmp_path / "run" / "checkpoints" / "step_4"
    tag.mkdir(parents=True)
    (tag / "complete.json").write_text('{"step": 4, "world_size": 1}', encoding="utf-8")
    result = tmp_path / "run" / "result.json"
    if kind == "fifo":
        os.mkfifo(result)
    else:
        result.write_text(DEEP, encoding="utf-8")
    cfg = make_cfg("debug=fast", check_files=False)
    assert check_budget(cfg, ResumePlan(str(tag), 4, 1, False), 100) is False  # steps left: resumes


def test_model_settings_replaced_after_their_check_are_one_message(tmp_path):
    # score's config_labels, chat/prompt-eval's adapter_config and _run_of, and the pipeline's generates read a model
    # directory's JSON again after custom_code_problems / check_loadable read it bounded; replaced in between by 100000
    # '[' it was json's RecursionError (a traceback). No command was seen reaching them without the swap.
    from dsrecipes.core.errors import UserError
    from dsrecipes.core.tokenizer import config_labels
    from dsrecipes.serve.inference import _run_of, adapter_config
    from dsrecipes.serve.pipeline_prompts import generates

    for name in ("config.json", "adapter_config.json", "dsrecipes_export.json"):
        (tmp_path / name).write_text(DEEP, encoding="utf-8")
    with pytest.raises(UserError, match="config.json: not a readable JSON model config .JSON nested too deeply"):
        config_labels(tmp_path / "config.json")
    with pytest.raises(UserError, match="adapter_config.json: unreadable .JSON nested too deeply"):
        adapter_config(tmp_path)
    assert _run_of(tmp_path) is None
    (tmp_path / "adapter_config.json").unlink()
    assert generates(tmp_path) is False


@pytest.mark.timeout(20)  # the FIFO blocked the waiting process for ever before
@pytest.mark.parametrize("kind", ["deep", "fifo", "list"])
def test_a_hostile_lock_file_describes_its_holder_without_its_words(kind, tmp_path):
    # Was: core/locks.describe_holder (what a process waiting on a lock in a shared cache prints, and LockHeld says)
    # json.loads'd the lock file: 100000 '[' was a RecursionError traceback, a FIFO blocked for ever, a list was an
    # AttributeError.
    from dsrecipes.core.locks import describe_holder

    lock = tmp_path / "prepare.lock"
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.write_text(DEEP if kind == "deep" else '["pid", 1]', encoding="utf-8")
    assert describe_holder(lock) == "another process"  # nobody holds it: the kernel lists no pid


@pytest.mark.parametrize("marker", ["dsrecipes_run.json", "dsrecipes_inspect.json"])
def test_a_directory_whose_marker_is_nested_too_deeply_is_not_ours(marker, tmp_path, capsys, monkeypatch):
    # Was: core/rundir.read_marker (trainer.output_dir holding dsrecipes_run.json) and claim_marked_dir (inspect-data
    # --run-dir, pipeline --out, a sweep directory) json.loads'd the marker of a directory someone else may have made:
    # 100000 '[' there ended `dsrecipes train trainer.output_dir=DIR` / `dsrecipes inspect-data --run-dir DIR` in a
    # RecursionError traceback.
    from dsrecipes.cli import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / marker).write_text(DEEP, encoding="utf-8")
    if marker == "dsrecipes_run.json":
        assert main(["train", "debug=fast", f"trainer.output_dir={out}"]) == 2
        one_error(capsys, f"{out / marker} is unreadable (JSON nested too deeply)")
    else:
        assert main(["inspect-data", "debug=fast", "--run-dir", str(out)]) == 2
        one_error(capsys, f"{out / marker} is not our marker")
    assert sorted(os.listdir(out)) == [marker]


def test_a_run_dirs_metrics_line_or_ds_config_nested_too_deeply_is_one_message(tmp_path):
    # Was: rundir.read_metrics and read_ds_config json.loads'd a run directory's metrics.jsonl lines / ds_config.json
    # (bounded in size, not in depth): 100000 '[' was a RecursionError, not the UserError naming file:line.
    from dsrecipes.core.errors import UserError
    from dsrecipes.core.rundir import read_ds_config, read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n' + DEEP + "\n" + '{"step": 2}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"metrics.jsonl:2: not a metrics record \(Unreadable: JSON nested too deeply"):
        read_metrics(tmp_path)
    (tmp_path / "ds_config.json").write_text(DEEP, encoding="utf-8")
    with pytest.raises(UserError, match=r"ds_config.json: JSON nested too deeply, not the DeepSpeed config"):
        read_ds_config(tmp_path)


def test_a_runs_prepare_stats_nested_too_deeply_is_one_message(make_cfg, tmp_path):
    # Was: data/prepare/build.load_prepared json.loads'd RUN/prepare_stats.json (prompt-eval --finetuned RUN reads
    # the validation split of a run that may be another user's, under --trust-checkpoint; every map rank reads it):
    # 100000 '[' was a RecursionError traceback.
    from dsrecipes.core.errors import DataError
    from dsrecipes.data.prepare.build import STATS_FILE, load_prepared

    (tmp_path / STATS_FILE).write_text(DEEP, encoding="utf-8")
    with pytest.raises(DataError, match=f"{STATS_FILE}: not the preparation record dsrecipes writes .JSON nested too"):
        load_prepared(make_cfg("debug=fast", check_files=False), tmp_path)


def test_audit_ledger_line_nested_too_deeply_is_one_message(tmp_path, capsys):
    # Was: data/plan/ledger._record caught ValueError only: `dsrecipes audit --ledger RUN` on a run directory someone
    # else wrote, with a ledger line of 100000 '[', ended in json's RecursionError traceback.
    from dsrecipes.cli import main

    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "rank0.jsonl").write_text(DEEP + "\n")
    assert main(["audit", "--ledger", str(tmp_path)]) == 2
    one_error(capsys, "rank0.jsonl:1: not a ledger record")


def test_a_foreign_checkpoints_data_position_or_universal_record_nested_too_deeply(tmp_path):
    # Was: rank/checkpoint.load_checkpoint json.loads'd data_state/rank<R>.json of a checkpoint trusted with
    # --trust-checkpoint (its hashes match: its writer wrote both), a RecursionError traceback in every rank;
    # universal_verifies read universal/complete.json (anyone's, beside such a checkpoint) the same way.
    from dsrecipes.boundary.point_of_use import ChangedCheckpoint
    from dsrecipes.rank.checkpoint import data_position, universal_verifies

    state = tmp_path / "rank0.json"
    with pytest.raises(ChangedCheckpoint, match="rank0.json: not as dsrecipes writes it .*nested too deeply"):
        data_position(DEEP.encode(), state)
    (tmp_path / "complete.json").write_text(DEEP)
    assert universal_verifies(tmp_path) is False
