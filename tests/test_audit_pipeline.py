"""`dsrecipes audit --ledger PIPELINE_DIR`: one real tiny pipeline (SFT, then a reward model and DPO on two shares
of the same pairs file, as DeepSpeed-Chat's --data_split), audited whole: every stage's ledger, the shares the
stages took, the split's shares disjoint and covering. Hostile: the same pipeline's record with two stages on one
share, or one stage reading the split file whole (its config.yaml edited as a wrong pipeline would have written it),
is a violation (exit 1); a state file naming a stage outside the pipeline is one message (exit 2)."""

from __future__ import annotations

import json

import pytest

from dsrecipes.run.pipeline import STATE_FILE
from tests.helpers.split_pipeline import audit, copy_of, edit_config, point_at_a_copy


@pytest.fixture
def pipeline_out(split_pipeline_out):
    return split_pipeline_out


def test_a_split_pipeline_audits_whole(pipeline_out, capsys):
    code, said = audit(pipeline_out, capsys)
    assert code == 0, said.out + said.err
    out = said.out
    assert out.startswith(f"audit pipeline {pipeline_out}: stages sft (done), reward (done), dpo (done)"), out
    for stage in ("sft", "reward", "dpo"):  # each stage's own ledger audit, as `--ledger RUN` prints it
        assert f"stage {stage}: {pipeline_out / stage}\nledger: 1 rank(s), epochs [0]\n  rank 0: 2 steps, 4 samples\nOK\n" in out
    assert "took 'reward'" in out and "took 'dpo'" in out, out
    assert "OK: the shares are disjoint and cover every row" in out, out
    assert out.rstrip().endswith("OK: 3 finished stage(s); ledgers of 3 checked; the stages that split a dataset "
                                 "took disjoint shares"), out


def test_two_stages_on_one_share_is_a_violation(pipeline_out, tmp_path, capsys):
    out = copy_of(pipeline_out, tmp_path)
    edit_config(out / "dpo", shares={"reward": 1, "dpo": 1}, take="reward")
    code, said = audit(out, capsys)
    assert code == 1, said.out
    assert "VIOLATION: stages reward, dpo all trained share 'reward' of " in said.out, said.out
    _and_its_ledger_holds_the_dpo_share(said.out)


def _and_its_ledger_holds_the_dpo_share(out: str) -> None:
    """The config says dpo took 'reward'; its ledger (not edited) holds its 4 rows of share 'dpo': each a violation."""
    held = [line for line in out.splitlines() if line.startswith("VIOLATION: stage dpo took share 'reward' of ")]
    assert len(held) == 4 and all(line.endswith(", a row of share 'dpo'") for line in held), out
    assert out.rstrip().endswith("FAILED: 5 violation(s)"), out


def test_a_stage_reading_the_split_file_whole_is_a_violation(pipeline_out, tmp_path, capsys):
    out = copy_of(pipeline_out, tmp_path)
    edit_config(out / "dpo")  # no split: every pair, the reward stage's share too
    code, said = audit(out, capsys)
    assert code == 1, said.out
    assert "VIOLATION: stage dpo read " in said.out and "while reward split it" in said.out, said.out


def test_an_unfinished_stage_is_listed_not_audited(pipeline_out, tmp_path, capsys):
    out = copy_of(pipeline_out, tmp_path)
    state = json.loads((out / STATE_FILE).read_text())
    state["stages"]["dpo"]["status"] = "interrupted"
    (out / STATE_FILE).write_text(json.dumps(state))
    code, said = audit(out, capsys)
    assert code == 0, said.out
    assert "not audited (not finished): dpo" in said.out and "OK: 2 finished stage(s)" in said.out, said.out


def test_a_split_file_changed_since_a_stage_read_it_is_a_violation(pipeline_out, tmp_path, capsys):
    """The stages read the bundled pairs through the registry; here they point at a copy of registry and file (as
    if trained on it, their plan.json recording the bundled file's hash), and the copy holds 50 rows only."""
    from dsrecipes.core.paths import ASSETS_DIR

    out = copy_of(pipeline_out, tmp_path)
    data = point_at_a_copy(out, tmp_path)
    original = ASSETS_DIR / "sample_data" / "pairs.jsonl"
    (data / "pairs.jsonl").write_text("".join(original.open().readlines()[:50]))
    code, said = audit(out, capsys)
    assert code == 1, said.out
    for stage in ("reward", "dpo"):
        assert f"VIOLATION: {data / 'pairs.jsonl'} changed since stage {stage} trained on it (content " in said.out, said.out
    assert "audit dataset.split: 50 rows" in said.out, said.out  # what it read: the file as it is now


@pytest.mark.parametrize("stages", [{"../elsewhere": {"status": "done"}}, {}, "garbage"])
def test_a_state_file_that_is_not_the_pipelines_is_one_message(pipeline_out, tmp_path, capsys, stages):
    out = copy_of(pipeline_out, tmp_path)
    (out / STATE_FILE).write_text(json.dumps({"stages": stages}))
    code, said = audit(out, capsys)
    assert code == 2 and "Traceback" not in said.err, said
    assert said.err.strip().startswith("error: --ledger: ") and len(said.err.strip().splitlines()) == 1, said.err


def _through_a_link(out, tmp_path, stages):
    """`stages` read the bundled pairs through another spelling of the same file: their registry moved to a copy
    (point_at_a_copy, plan.json recording that spelling) whose pairs.jsonl is a link to the bundled file."""
    from dsrecipes.core.paths import ASSETS_DIR

    pairs = ASSETS_DIR / "sample_data" / "pairs.jsonl"
    data = point_at_a_copy(out, tmp_path, stages)
    (data / "pairs.jsonl").symlink_to(pairs)
    return str(pairs), str(data / "pairs.jsonl")


def test_a_split_file_spelled_otherwise_by_one_stage_is_one_split_audited_once(pipeline_out, tmp_path, capsys):
    """dpo reads the pairs reward splits through a link: the same file, so one split (its shares audited once), named
    as reward names it with dpo's spelling beside. Was: two splits of one member each, each audited."""
    out = copy_of(pipeline_out, tmp_path)
    real, link = _through_a_link(out, tmp_path, ("dpo",))
    code, said = audit(out, capsys)
    assert code == 0, said.out
    assert said.out.count("audit dataset.split: ") == 1, said.out
    assert (f'split {{"dpo": 1, "reward": 1}} of {real} (stage dpo names it {link}): reward took \'reward\', dpo '
            "took 'dpo'\n") in said.out, said.out


@pytest.mark.parametrize("linked", [("dpo",), ("reward", "dpo")])
def test_stages_on_one_share_of_a_file_spelled_otherwise_name_it_as_written(pipeline_out, tmp_path, capsys, linked):
    """Two stages on share 'reward' of the pairs, one or both through a link: one overlap, the file named as the
    stages name it. Was: named by its resolved path, a name no stage used, beside the changed-file lines' spelling."""
    out = copy_of(pipeline_out, tmp_path)
    real, link = _through_a_link(out, tmp_path, linked)
    edit_config(out / "dpo", shares={"reward": 1, "dpo": 1}, take="reward")
    code, said = audit(out, capsys)
    assert code == 1, said.out
    name, aka = (real, f" (stage dpo names it {link})") if linked == ("dpo",) else (link, "")
    assert f"VIOLATION: stages reward, dpo all trained share 'reward' of {name}{aka}\n" in said.out, said.out
    _and_its_ledger_holds_the_dpo_share(said.out)


def _ledger_ids(run):
    return [i for line in (run / "ledger" / "rank0.jsonl").read_text().splitlines()
            for i in json.loads(line).get("ids", [])]


def test_each_stages_ledger_is_traced_to_the_share_it_took(pipeline_out, capsys):
    code, said = audit(pipeline_out, capsys)
    assert code == 0, said.out
    for stage, take in (("reward", "reward"), ("dpo", "dpo")):
        n = len(set(_ledger_ids(pipeline_out / stage)))
        assert (f"stage {stage}: its ledger holds {n} sample ids; {n} name rows of one share of the split: {n} of "
                f"share {take!r}, the share it took") in said.out, said.out


def test_a_ledger_holding_a_row_of_another_share_is_a_violation(pipeline_out, tmp_path, capsys):
    """The configs say disjoint shares, and each stage's own ledger audit passes (every id once, equal steps), but
    the dpo stage's ledger holds a row of the reward share: the ledger, not the config, is what the model trained
    on. Was: OK (the pipeline audit compared the configs' selections only)."""
    out = copy_of(pipeline_out, tmp_path)
    stolen = _ledger_ids(out / "reward")[0]
    ledger = out / "dpo" / "ledger" / "rank0.jsonl"
    lines = ledger.read_text().splitlines()
    for k, line in enumerate(lines):
        rec = json.loads(line)
        if rec.get("ids"):
            rec["ids"][0] = stolen
            rec.pop("keys", None)  # a key names the dpo run's own prepared row: without it the audit counts ids
            lines[k] = json.dumps(rec)
            break
    ledger.write_text("\n".join(lines) + "\n")
    code, said = audit(out, capsys)
    assert code == 1, said.out
    assert "VIOLATION: stage dpo took share 'dpo' of " in said.out, said.out
    assert f", but its ledger holds {stolen!r}, a row of share 'reward'\nFAILED: 1 violation(s)" in said.out, said.out
