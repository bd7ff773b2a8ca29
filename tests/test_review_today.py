"""A hostile review of the features landed on 2026-12-07 (5f0a12d..32c0b69): each test is a bug found through the real
CLI and fails without its fix.

`dsrecipes audit --ledger PIPELINE_OUT` (commands/audit_pipeline.py), on one real tiny pipeline (SFT, then reward and
DPO on two shares of the bundled pairs), its stage records edited as a wrong pipeline would have written them:
- two stages splitting one file with different dataset.split.shares took overlapping rows (reward 848 of 1681 rows,
  dpo 1235): was "OK ... took disjoint shares", exit 0;
- a stage reading the split file whole through another spelling of it (a symlink, a glob) was not compared: the
  stages were keyed by the path strings as written;
- a stage directory replaced by a link to another run was audited as that stage;
- a FIFO as pipeline_state.json was "lists no stage yet" (it is no regular file; never opened either way)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dsrecipes.run.pipeline import STATE_FILE
from tests.conftest import in_process_environ
from tests.helpers.split_pipeline import audit, copy_of, edit_config, point_at_a_copy

PAIRS = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "pairs.jsonl"


@pytest.fixture
def pipeline_out(split_pipeline_out):
    return split_pipeline_out


def test_stages_splitting_one_file_with_other_shares_overlap(pipeline_out, tmp_path, capsys):
    out = copy_of(pipeline_out, tmp_path)
    edit_config(out / "dpo", shares={"other": 1, "dpo": 3}, take="dpo")  # 3/4 of the rows: half are reward's
    code, said = audit(out, capsys)
    assert code == 1, said.out
    assert (f"VIOLATION: stages reward and dpo split {PAIRS} with different dataset.split.shares "
            '({"dpo": 1, "reward": 1} vs {"dpo": 3, "other": 1}): their shares can hold the same rows') in said.out
    assert said.out.rstrip().endswith("FAILED: 1 violation(s)"), said.out


def test_a_stage_reading_the_split_file_whole_by_another_name_is_a_violation(pipeline_out, tmp_path, capsys):
    import yaml

    out = copy_of(pipeline_out, tmp_path)
    link = tmp_path / "my_pairs.jsonl"
    link.symlink_to(PAIRS)
    path = out / "dpo" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["dataset"].update(registry=None, use=[], paths=[str(tmp_path / "my_pair*.jsonl")],
                             split={"shares": {}, "take": None, "pin": {}})
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, said = audit(out, capsys)
    assert code == 1, said.out
    assert f"VIOLATION: stage dpo read {PAIRS} whole while reward split it" in said.out, said.out


def test_a_stage_directory_linked_elsewhere_is_not_audited_as_the_stage(pipeline_out, tmp_path, capsys):
    out = copy_of(pipeline_out, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (out / "dpo").rename(elsewhere)
    (out / "dpo").symlink_to(elsewhere)
    code, said = audit(out, capsys)
    assert code == 1, said.out
    assert f"VIOLATION: stage dpo: {out / 'dpo'} is a link to {elsewhere}, not what the pipeline wrote" \
        in said.out, said.out


@pytest.mark.parametrize("entry", ["ledger", "config.yaml", "plan.json"])
def test_a_stage_record_linked_to_another_stages_is_not_audited(pipeline_out, tmp_path, capsys, entry):
    """dpo's ledger (or config.yaml, plan.json) replaced by a link to reward's: was audited as dpo's own, exit 0."""
    out = copy_of(pipeline_out, tmp_path)
    shutil.rmtree(out / "dpo" / entry) if entry == "ledger" else (out / "dpo" / entry).unlink()
    (out / "dpo" / entry).symlink_to(out / "reward" / entry)
    code, said = audit(out, capsys)
    assert code == 1, said.out
    assert f"VIOLATION: stage dpo: {out / 'dpo' / entry} is a link to {out / 'reward' / entry}, not what the " \
        "pipeline wrote: not audited" in said.out, said.out


def test_a_fifo_as_the_state_file_is_named_as_such(pipeline_out, tmp_path, capsys):
    out = copy_of(pipeline_out, tmp_path)
    (out / STATE_FILE).unlink()
    os.mkfifo(out / STATE_FILE)  # opened for reading, it would block until a writer comes
    code, said = audit(out, capsys)
    assert code == 2 and said.out.count("\n") <= 1, said.out + said.err
    assert said.err.strip() == (f"error: --ledger: {out / STATE_FILE} does not read as a pipeline's state (not a "
                                "regular file)"), said.err


def test_a_presharded_stage_is_said_not_compared_not_called_a_whole_reader(pipeline_out, tmp_path, capsys):
    """data=presharded trains on `dsrecipes shard`'s parts (the share chosen when sharding, recorded nowhere); its
    config.yaml still names the dataset it was sharded from: was 'stage dpo read ... whole', a false violation."""
    import yaml

    out = copy_of(pipeline_out, tmp_path)
    path = out / "dpo" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["data"].update(kind="presharded", shard_dir=str(tmp_path / "shards"))
    config["objective"]["reference"] = "live"  # DPO on presharded data (no preparation pass to precompute it in)
    config["dataset"]["split"] = {"shares": {}, "take": None, "pin": {}}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    code, said = audit(out, capsys)
    assert code == 0, said.out
    assert ("stage dpo: data=presharded: the share it trained on was chosen by `dsrecipes shard` and is not recorded; "
            "its rows are not compared with the other stages'") in said.out, said.out


def test_train_on_all_trains_a_prompt_list_but_not_its_assistant_turn(tmp_path, capsys):
    """README said `data.train_on=all` trains both prompt and completion of TRL's prompt/completion rows; an assistant
    turn inside a prompt list is read at OpenAI's weight 0 and stays context even then (README now says so). inspect-data
    shows trained tokens in [[...]]. Pins the documented behaviour (docs fix: this passed before too)."""
    import json

    from dsrecipes.cli import main

    row = {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital?"}],
           "completion": [{"role": "assistant", "content": "Paris."}]}
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with in_process_environ():
        assert main(["inspect-data", "dataset=openai_messages", f"dataset.paths=[{path}]", "dataset.val_size=0",
                     "data.train_on=all", f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    out = capsys.readouterr().out
    assert "[[<|im_start|>system\nBe terse." in out and "]]Hello.<|im_end|>[[" in out, out
    assert "Paris.<|im_end|>]]" in out, out
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "`data.train_on=all` trains both" not in readme


def test_an_alpaca_pair_under_pairs_as_chosen_says_which_formats_it_reads(tmp_path):
    """LLaMA-Factory's alpaca ranking rows (instruction/input/chosen/rejected) under dataset.pairs_as=chosen were
    'missing_field (no 'output' field)': nothing said the key the user set does not read that format."""
    import json
    import subprocess
    import sys

    path = tmp_path / "alpaca_pairs.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Q{i}", "input": "", "chosen": f"good {i}",
                                        "rejected": f"bad {i}"}) + "\n" for i in range(4)))
    done = subprocess.run([sys.executable, "-m", "dsrecipes", "inspect-data", "dataset=alpaca", f"dataset.paths=[{path}]",
                           "dataset.val_size=0", "dataset.pairs_as=chosen", f"data.cache_dir={tmp_path / 'cache'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (f"error: {path}:1: preference_row (an alpaca pair ('chosen'/'rejected')); "
                                   "dataset.pairs_as=chosen reads pairs in the sharegpt or openai format, as "
                                   "objective=dpo does"), done.stderr


@pytest.mark.parametrize("gone", ["deleted", "fifo"])
def test_a_split_file_gone_since_the_stages_read_it_is_a_violation(pipeline_out, tmp_path, capsys, gone):
    """As test_audit_pipeline's changed-file case: the stages point at a copy of registry and pairs file (their
    plan.json recording it with the bundled file's hash); the copy is then deleted or replaced by a FIFO. Was: the
    split audit read 0 rows, 'OK: the shares are disjoint and cover every row', exit 0 (only files present now were
    compared with plan.json)."""
    out = copy_of(pipeline_out, tmp_path)
    data = point_at_a_copy(out, tmp_path)
    if gone == "fifo":
        os.mkfifo(data / "pairs.jsonl")  # never opened: not a regular file
    code, said = audit(out, capsys)
    assert code == 1, said.out
    for stage in ("reward", "dpo"):
        assert (f"VIOLATION: {data / 'pairs.jsonl'} is gone (or no longer a regular file) since stage {stage} trained "
                "on it: the audit reads none of its rows") in said.out, said.out


def test_a_state_file_stage_name_cannot_forge_the_audits_verdict(pipeline_out, tmp_path, capsys):
    """A stage name in pipeline_state.json holding a newline printed as its own line: 'OK: 9 finished stage(s) ...'
    in a pipeline audit's output (an unfinished stage is listed by name). Names are now the pipeline file's own
    (letters, digits, _ and -, a letter first): anything else is one message, exit 2."""
    import json

    out = copy_of(pipeline_out, tmp_path)
    state = json.loads((out / STATE_FILE).read_text())
    state["stages"]["x\nOK: 9 finished stage(s)"] = {"status": "running"}
    (out / STATE_FILE).write_text(json.dumps(state))
    code, said = audit(out, capsys)
    assert code == 2 and "OK: 9" not in said.out, said.out
    assert said.err.strip() == (f"error: --ledger: {out / STATE_FILE}: 'x\\nOK: 9 finished stage(s)' is not a stage "
                                "name the pipeline writes"), said.err


@pytest.mark.parametrize("split, said", [
    ({"shares": {"reward": 1, "dpo": 1}, "take": "nope"}, "dataset.split.take: 'nope' is not a share"),
    ({"shares": {"reward": "x", "dpo": 1}, "take": "dpo"}, "dataset.split.shares.reward: expected an integer"),
])
def test_a_stage_config_problem_names_the_stages_config_file(pipeline_out, tmp_path, capsys, split, said):
    """Was 'error: dataset.split.take: ...' alone: which of the pipeline's config.yaml files said it was not named."""
    out = copy_of(pipeline_out, tmp_path)
    edit_config(out / "dpo", **split)
    code, got = audit(out, capsys)
    assert code == 2 and "Traceback" not in got.err, got.err
    assert got.err.strip().startswith(f"error: --ledger: {out / 'dpo' / 'config.yaml'}: {said}"), got.err
    assert len(got.err.strip().splitlines()) == 1, got.err
