"""A DeepSpeed-Chat user's first day with `dsrecipes pipeline` (SFT -> reward model -> RL on one dataset split like
`--data_split 2,4,4`): what such a user does, and what used to go wrong.

Hostile: stages that split the same shares with other weights (each stage's shares are disjoint and covering on
their own, so every per-run check passed while the reward model's rows were RL prompts), and an RL stage that takes
the very share its reward model trained on, are refused before the first stage runs, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsrecipes.config.pipeline_file import load_pipeline
from dsrecipes.core.errors import UserError
from dsrecipes.run.pipeline import check_stages

THREE_STEPS = """\
shared:
  debug: fast
  dataset.paths:
    - ${{dsr.asset:sample_data}}/pairs.jsonl
stages:
  - name: reward
    set:
      objective: reward
      dataset.split.shares: {reward_shares}
      dataset.split.take: reward
  - name: grpo
    from_export: {{objective.reward_model: reward}}
    set:
      objective: grpo
      dataset.split.shares: {rl_shares}
      dataset.split.take: {rl_take}
      objective.rewards: [{{name: length, max_chars: 40}}]
"""


def refusal(tmp_path: Path, **fields: str) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(THREE_STEPS.format(**fields), encoding="utf-8")
    with pytest.raises(UserError) as err:
        check_stages(load_pipeline(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    return "\n".join(err.value.problems)


def test_stages_splitting_the_same_shares_with_other_weights_are_refused(tmp_path):
    said = refusal(tmp_path, reward_shares="{sft: 2, reward: 4, rl: 4}", rl_shares="{sft: 2, reward: 2, rl: 6}",
                   rl_take="rl")
    assert "stage 'grpo' (line 11): dataset.split.shares={reward:2,rl:6,sft:2} differs from stage 'reward'" in said
    assert "set dataset.split.shares (and pin) once, under shared:" in said


def test_an_rl_stage_taking_its_reward_models_share_is_refused(tmp_path):
    said = refusal(tmp_path, reward_shares="{reward: 1, rl: 1}", rl_shares="{reward: 1, rl: 1}", rl_take="reward")
    assert "dataset.split.take=reward is the share its reward model (from_export objective.reward_model: reward)" in said


def test_the_same_split_taken_by_share_passes(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(THREE_STEPS.format(reward_shares="{sft: 2, reward: 4, rl: 4}",
                                       rl_shares="{rl: 4, reward: 4, sft: 2}", rl_take="rl"), encoding="utf-8")
    check_stages(load_pipeline(path), tmp_path / "out")


class ResumeRefused:
    """`train` as it answers a resumed stage whose settings differ from its checkpoint's (run/resume_contract.py)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, argv):
        from dsrecipes.run.pipeline import StageFailed

        self.calls += 1
        if self.calls == 1:
            raise KeyboardInterrupt  # Ctrl-C in the first stage
        raise StageFailed(2, ["cannot resume CKPT: these settings differ ... or start a new run in another "
                              "trainer.output_dir"])


def test_a_changed_split_names_the_keys_that_changed_and_the_pipelines_remedy(tmp_path):
    """Interrupted in the reward step, then the split edited: train refuses to resume the checkpoint under other
    settings and its remedy names trainer.output_dir, which a pipeline file may not set. The pipeline now says which
    keys changed since the stage started and what to do in a pipeline; a finished stage's refusal names them too."""
    from dsrecipes.run.pipeline import run_pipeline

    text = "stages:\n  - name: reward\n    set:\n      dataset.split.shares: {reward: 4, rl: 4}\n      dataset.split.take: reward\n"
    path = tmp_path / "p.yaml"
    path.write_text(text, encoding="utf-8")
    out, train = tmp_path / "out", ResumeRefused()
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(load_pipeline(path), out, train, "RESUME")
    path.write_text(text.replace("reward: 4, rl: 4", "reward: 5, rl: 3"), encoding="utf-8")
    with pytest.raises(UserError) as err:
        run_pipeline(load_pipeline(path), out, train, "RESUME")
    said = err.value.problems[0]
    assert "started with other settings (dataset.split.shares: {reward:4,rl:4} -> {reward:5,rl:3})" in said, said
    assert "restore them in " + str(path) + ", or start over with a new --out" in said


def test_a_finished_stage_given_another_split_is_refused_naming_the_key(tmp_path):
    from dsrecipes.run.pipeline import run_pipeline

    text = "stages:\n  - name: reward\n    set:\n      dataset.split.shares: {reward: 4, rl: 4}\n      dataset.split.take: reward\n"
    path = tmp_path / "p.yaml"
    path.write_text(text, encoding="utf-8")
    assert run_pipeline(load_pipeline(path), tmp_path / "out", lambda argv: 0, "RESUME") == 0
    path.write_text(text.replace("reward: 4, rl: 4", "reward: 2, rl: 6"), encoding="utf-8")
    with pytest.raises(UserError, match=r"finished with other settings than the file now gives it "
                                        r"\(dataset.split.shares: \{reward:4,rl:4\} -> \{reward:2,rl:6\}\)"):
        run_pipeline(load_pipeline(path), tmp_path / "out", lambda argv: 0, "RESUME")


def test_a_pipeline_takes_trust_checkpoint_for_a_reward_model_someone_else_wrote(tmp_path, monkeypatch):
    """A foreign reward model (signed by another user's key) in a pipeline stage: train refuses it and names
    `--trust-checkpoint`, which `dsrecipes pipeline` did not accept (argparse: unrecognized arguments), so the only
    way was to leave the pipeline. Now the flag is the pipeline's: every stage gets it as its own command line's (reset
    per stage), a refusal names the pipeline command to repeat, and the resume command carries it."""
    import dsrecipes.boundary.trust as trust
    import dsrecipes.commands.train as train
    from dsrecipes.cli import main

    foreign, seen = tmp_path / "their_rm", []
    foreign.mkdir()
    monkeypatch.setattr(train, "main", lambda argv: seen.append((trust.is_trusted(foreign), trust.run_command())) or 0)
    path = tmp_path / "p.yaml"
    path.write_text("stages:\n  - name: a\n  - name: b\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["pipeline", str(path), "--out", str(out), "--trust-checkpoint", str(foreign)]) == 0
    assert [s[0] for s in seen] == [True, True], seen
    assert seen[0][1].endswith(f"pipeline {path} --out {out} --trust-checkpoint {foreign.resolve()}"), seen


@pytest.mark.parametrize("override, says", [
    ("dataset.split.shares=2,4,4", "dataset.split.shares: share names and weights, "
                                   "e.g. '++dataset.split.shares={sft:2,reward:4,rl:4}'"),
    ("dataset.split.shares={sft:2,reward:4,rl:4}", "dataset.split.shares is a mapping: set its keys with "
                                                   "++dataset.split.shares=VALUE"),
    ("data_split=2,4,4", "data_split: DeepSpeed-Chat's option; here: '++dataset.split.shares={sft:2,reward:4,rl:4}'"),
    ("trainer.max_steps=1,2", "trainer.max_steps: a comma separates list items or sweep values: "
                              "trainer.max_steps=[a,b] (a list)"),
])
def test_a_data_split_written_as_deepspeed_chat_writes_it_names_the_key_and_the_spelling(make_cfg, override, says):
    """`--data_split 2,4,4` typed as an override: Hydra said 'Ambiguous value for argument' (no key of ours, no
    spelling that works), and `dataset.split.shares={...}` was told 'dataset.split is a mapping: add a key to it with
    +dataset.split.shares=VALUE' (the parent, for a key that exists)."""
    with pytest.raises(UserError) as err:
        make_cfg(override, check_files=False)
    assert err.value.problems[0].startswith(says), err.value.problems
    assert f"[from command-line override '{override}']" in err.value.problems[0]


def test_a_reward_models_new_score_head_report_goes_to_the_log_not_the_console(model_dir, make_cfg, tmp_path,
                                                                               monkeypatch):
    """Step 2 from an SFT export: transformers logs a LOAD REPORT table (with terminal escapes, also in a CI log)
    for the new `score.weight`, twice per run (the model, then the export), on the console the README keeps free of
    third-party noise. It is expected (objective=reward trains that head): now kept in the run's log; a report of
    anything else is still shown."""
    import logging

    import torch

    from dsrecipes.core.console import quiet_third_party
    from dsrecipes.modeling.model import load_pretrained, new_head_kept_in_log

    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        monkeypatch.setenv(var, "1")
    shown, logger = [], logging.getLogger("transformers.modeling_utils")
    handler = logging.Handler()
    handler.emit = lambda record: shown.append(record.getMessage())
    logger.addHandler(handler)
    log = tmp_path / "main.log"
    quiet_third_party(log)
    try:
        cfg = make_cfg("debug=fast", "objective=reward", "dataset=sample_pairs", f"model.path={model_dir}")
        load_pretrained(cfg, torch.float32, None)
        with new_head_kept_in_log(True):
            logger.warning("LlamaForCausalLM LOAD REPORT from: x\nKey | Status |\nlm_head.weight | MISSING |")
    finally:
        quiet_third_party(None)
        logger.removeHandler(handler)
    assert "score.weight" in log.read_text() and not any("score.weight" in m for m in shown), shown
    assert any("lm_head.weight | MISSING" in m for m in shown)


def test_an_adapter_only_reward_model_export_is_written(make_cfg, tmp_path, monkeypatch):
    """objective=reward model.lora.enabled=true trainer.export_merged_lora=false trained its steps, then rank 0
    crashed writing the export: AttributeError 'LlamaForSequenceClassification' object has no attribute
    'generation_config' (rank/export._save_hf saved the base's generation config for every adapter export). A
    scoring head has none: the adapter (with its whole score head) is written and signed."""
    import dsrecipes.rank.export as export
    from dsrecipes.modeling.model import add_lora, build_tiny_model, load_tokenizer

    monkeypatch.setenv("DSRECIPES_KEY_FILE", str(tmp_path / "key" / "checkpoint.key"))
    monkeypatch.setattr(export, "load_deepspeed", lambda: None)
    cfg = make_cfg("debug=fast", "objective=reward", "dataset=sample_pairs", "model.lora.enabled=true",
                   "trainer.export_merged_lora=false")
    tokenizer = load_tokenizer(cfg)
    model = add_lora(cfg, build_tiny_model(cfg, tokenizer))
    out = export._save_hf(model, tokenizer, tmp_path / "export", {"source": "test"})
    assert (out / "adapter_config.json").is_file() and (out / "dsrecipes_export.json").is_file()
    assert not (out / "generation_config.json").exists()


def test_a_reward_stage_exporting_only_an_adapter_is_refused_before_step_one(tmp_path):
    """grpo scored by a reward stage with trainer.export_merged_lora=false: an adapter-only export is no scorer
    (objective.reward_model refuses it), but the pipeline found out only after SFT and the reward model had trained."""
    path = tmp_path / "p.yaml"
    path.write_text(THREE_STEPS.format(reward_shares="{reward: 1, rl: 1}", rl_shares="{reward: 1, rl: 1}",
                                       rl_take="rl").replace("  debug: fast\n", "  debug: fast\n  model.lora.enabled: true\n"
                                                             "  trainer.export_merged_lora: false\n"), encoding="utf-8")
    with pytest.raises(UserError) as err:
        check_stages(load_pipeline(path), tmp_path / "out")
    said = "\n".join(err.value.problems)
    assert "stage 'reward' trains objective=reward with trainer.export_merged_lora=false (its export is an adapter" in said


def test_an_adapter_only_reward_run_is_told_to_merge_and_score_not_to_chat(tmp_path):
    """The closing 'next:' of objective=reward with trainer.export_merged_lora=false offered `prompt-eval` and `chat`
    (a scoring head writes no text; chat then pointed at the untrained export_init). Now: merge, then score."""
    import json

    from dsrecipes.observe.report import next_commands

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "adapter_config.json").write_text(json.dumps({"task_type": "SEQ_CLS"}))
    said = dict(next_commands(tmp_path, ["objective=reward"], 2, 2))
    assert "chat:" not in said and "compare:" not in said, said
    assert said["score pairs:"] == (f"dsrecipes export {tmp_path} --lora merged --out MERGED && dsrecipes score "
                                    "MERGED --pairs PAIRS.jsonl")


def test_grpos_reward_model_loads_whole_while_the_policy_trains_under_zero3(make_cfg, tmp_path, monkeypatch):
    """DeepSpeed-Chat users run step 3 with --zero_stage 3: SFT -> reward -> grpo with zero=stage3 crashed in the
    grpo stage's first sampling step ('weight' must be 2-D, from the reward model's embedding): the policy's
    HfDeepSpeedConfig (modeling/model.load_pretrained) made transformers partition the reward model's
    from_pretrained too, and it scores outside the engine. It is now loaded whole and scores."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    import dsrecipes.modeling.model as modeling
    from dsrecipes.modeling.model import build_tiny_model, load_tokenizer
    from dsrecipes.objectives.rewards import load_reward_model

    cfg = make_cfg("debug=fast", "objective=reward", "dataset=sample_pairs")
    tokenizer = load_tokenizer(cfg)
    build_tiny_model(cfg, tokenizer).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    monkeypatch.setattr(modeling, "_hf_zero3_config", zero3)
    assert is_deepspeed_zero3_enabled()
    try:
        score = load_reward_model(str(tmp_path / "rm"), "cpu")
        assert is_deepspeed_zero3_enabled()  # the policy's setting is back
        assert len(score(["a prompt and its answer", "another"])) == 2
    finally:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def test_an_interpolation_in_a_flow_list_says_how_to_write_it(tmp_path):
    """`dataset.paths: [${dsr.asset:sample_data}/pairs.jsonl]` (as a README command line writes it) was 'not valid
    YAML: expected ',' or ']', but got '{'', naming the line but not why; now it says to quote it or use a block list,
    and the quoted form loads."""
    text = "stages:\n  - name: a\n    set:\n      dataset.paths: [{}]\n"
    path = tmp_path / "p.yaml"
    path.write_text(text.format("${dsr.asset:sample_data}/pairs.jsonl"), encoding="utf-8")
    with pytest.raises(UserError) as err:
        load_pipeline(path)
    assert err.value.problems[0].startswith(f"{path}:4: not valid YAML: ")
    assert "inside [ ] or { } a ${...} value needs quotes" in err.value.problems[0]
    path.write_text(text.format("'${dsr.asset:sample_data}/pairs.jsonl'"), encoding="utf-8")
    assert load_pipeline(path).stages[0].settings[0].value == ["${dsr.asset:sample_data}/pairs.jsonl"]


def test_chat_refuses_an_adapter_only_reward_model_naming_merge_and_score(model_dir, tmp_path):
    """`dsrecipes chat RUN` of objective=reward with trainer.export_merged_lora=false loaded the SEQ_CLS adapter onto
    its causal base and 'chatted' (an empty answer, exit 0): the scorer refusal of a merged reward export was skipped
    for adapters. Now refused the same way, naming how to merge and score."""
    import json

    from dsrecipes.serve.inference import resolve_model_path

    adapter = tmp_path / "export"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"task_type": "SEQ_CLS", "peft_type": "LORA",
                                                             "base_model_name_or_path": str(model_dir)}))
    with pytest.raises(UserError, match=r"a LoRA adapter of a reward model \(task_type SEQ_CLS: objective=reward\) "
                                        r"scores answers .* dsrecipes export .* --lora merged --out MERGED && "
                                        r"dsrecipes score MERGED"):
        resolve_model_path(str(adapter))


def test_score_and_reward_model_name_the_merge_for_an_adapter_only_export(tmp_path, capsys):
    """`dsrecipes score RUN[/export]` and objective.reward_model=RUN/export of an adapter-only reward export said
    'no config.json; give an objective=reward export' without saying the export is an adapter to merge."""
    from dsrecipes.cli import main
    from dsrecipes.objectives.rewards import reward_model_problems

    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    (run / "export" / "adapter_config.json").write_text('{"task_type": "SEQ_CLS"}')
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")
    merge = f"merge it first, dsrecipes export {run} --lora merged --out MERGED, and give MERGED"
    for target in (run, run / "export"):
        assert main(["score", str(target), "--pairs", str(pairs), "--out", str(tmp_path / "r.jsonl")]) == 2
        assert merge in capsys.readouterr().err
    assert merge in reward_model_problems(str(run / "export"))[0]


def test_deepspeed_chat_options_name_our_keys():
    """DeepSpeed-Chat's flags (--data_split 2,4,4, --lora_dim, --num_padding_at_beginning, ...) were 'unknown key'."""
    from dsrecipes.config.foreign_keys import foreign_key

    assert foreign_key("data_split", "2,4,4").startswith(
        "DeepSpeed-Chat's option; here: '++dataset.split.shares={sft:2,reward:4,rl:4}'")
    assert foreign_key("lora_dim", 128).startswith("DeepSpeed-Chat's option; here: model.lora.r: 128")
    assert foreign_key("zero_stage", 3).startswith("DeepSpeed-Chat's option; here: zero=stage3")
    assert foreign_key("num_padding_at_beginning", 1).startswith("not needed here")
    assert foreign_key("offload", True) is None  # our own group's name: never taken for DeepSpeed-Chat's flag
