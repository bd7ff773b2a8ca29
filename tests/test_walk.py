"""A first afternoon with dsrecipes, as a TRL / LLaMA-Factory user walks it: the commands they type first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_help_is_a_command_as_in_llamafactory_cli(capsys):
    """`llamafactory-cli help` is what such a user types first: was 'help' is not a command (exit 2)."""
    from dsrecipes.cli import main, usage
    from tests.test_readme import README

    assert "\ndsrecipes help [COMMAND] " in README

    assert main(["help"]) == 0
    assert capsys.readouterr().out.strip() == usage().strip()
    with pytest.raises(SystemExit) as done:  # argparse's --help, as `dsrecipes score --help` ends
        main(["help", "score"])
    assert done.value.code == 0 and "--pairs" in capsys.readouterr().out  # score's own help
    assert main(["help", "train"]) == 0
    assert capsys.readouterr().out.startswith("usage: dsrecipes [train]")


@pytest.mark.parametrize("argv,needle", [
    (["help", "valdate"], "dsrecipes help takes one command, not 'valdate'; did you mean validate?"),
    (["help", "score", "x"], "dsrecipes help takes one command, not 'score x'"),
])
def test_help_of_no_command_is_one_message(argv, needle, capsys):
    from dsrecipes.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("error:") == 1, err


def test_score_names_what_it_was_given_instead_of_a_reward_export(capsys, tmp_path):
    """`dsrecipes score runs/dpo/export` said 'a reward model has one label, this one has 2': a causal LM's config
    declares no labels (transformers' default 2), so the count named nothing the user did; `dsrecipes score runs/rm`
    (a run directory, as chat and prompt-eval take) did not name the run's export."""
    import json

    from tests.test_messages_hostile import refused

    pairs = str(Path(__file__).parents[1] / "dsrecipes/assets/sample_data/pairs.jsonl")
    lm = tmp_path / "run" / "export"
    lm.mkdir(parents=True)
    (lm / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (lm / "model.safetensors").write_bytes(b"")  # never read: refused before loading
    out = str(tmp_path / "r.jsonl")
    refused(capsys, ["score", str(lm), "--pairs", pairs, "--out", out],
            f"{lm}: a text-generating model (LlamaForCausalLM), not a reward model", "objective=reward run")
    refused(capsys, ["score", str(lm.parent), "--pairs", pairs, "--out", out],
            f"{lm.parent}: not a model directory (no config.json)", f"its export is {lm}")


def test_pipeline_prompt_answers_keep_third_party_bars_off_the_console(tmp_path, monkeypatch):
    """`dsrecipes pipeline FILE` again after every stage finished runs no stage (the stages quiet transformers), and
    the prompt answers printed transformers' 'Loading weights: 100%|...' bar once per model."""
    from types import SimpleNamespace

    import dsrecipes.core.console as console
    import dsrecipes.serve.pipeline_prompts as pipeline_prompts
    from dsrecipes.commands.pipeline import prompt_answers

    monkeypatch.setattr(console._SINK, "path", None)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    seen = {}

    def answers(out, stages, limit, max_new_tokens):
        seen.update(bars=os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"), log=console.current_log())
        return "table"

    monkeypatch.setattr(pipeline_prompts, "answer_stages", answers)
    pipeline = SimpleNamespace(stages=[SimpleNamespace(name="sft")], prompts=SimpleNamespace(limit=4, max_new_tokens=8))
    assert prompt_answers(pipeline, tmp_path) == "table"
    assert seen == {"bars": "1", "log": tmp_path / "logs" / "prompts.log"}


@pytest.mark.parametrize("config,needle", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
     "is a text-generating model (LlamaForCausalLM), not a reward model"),
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3}, "has 3 labels in config.json"),
])
def test_grpo_refuses_a_reward_model_without_a_one_label_head(tmp_path, config, needle):
    """`objective=grpo objective.reward_model=runs/sft/export` (the SFT export instead of the reward stage's) validated
    OK and trained: AutoModelForSequenceClassification gave the causal LM a new random 2-label head and logits[:, 0]
    was every completion's reward."""
    import json

    from dsrecipes.objectives.rewards import reward_model_problems

    model = tmp_path / "export"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")
    (problem,) = reward_model_problems(str(model))
    assert problem.startswith(f"objective.reward_model: {model} ") and needle in problem, problem
    assert "objective=reward export" in problem
    from tests.test_readme import README

    assert "a one-label score head: an SFT or DPO\n  export, whose head would be new and random, is refused" in README
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"],
                                                   "id2label": {"0": "LABEL_0"}}))  # as objective=reward exports it
    assert reward_model_problems(str(model)) == []


def test_the_readme_grpo_command_rewards_a_number_with_its_regex():
    """The README's GRPO example wrote `pattern: "^\\\\d+$"` inside shell single quotes: Hydra keeps both backslashes
    (it unescapes only before a quote), so the reward searched for a literal backslash and 'd' and never paid '42'."""
    import re
    import shlex

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.objectives.rewards import check_of
    from tests.test_readme import README

    lines = re.search(r"\n    python -m dsrecipes objective=grpo (.*?\n.*?)\n", README).group(1).replace("\\\n", " ")
    rewards = next(w for w in shlex.split(lines) if w.startswith("objective.rewards="))
    cfg = compose_and_load(["objective=grpo", rewards])
    (regex,) = [r for r in cfg.objective.rewards if r.name == "regex"]
    assert check_of(regex)("42", "42") == 1.0 and check_of(regex)("forty-two", "42") == 0.0, regex.pattern


def test_a_pipeline_refuses_a_reward_model_stage_that_trains_no_reward_model(tmp_path):
    """`from_export: {objective.reward_model: dpo}` ran the sft and dpo stages, then the grpo stage was refused (or,
    before the one-label check, trained on a random head's rewards): the stage's objective says so before any runs."""
    from dsrecipes.config.pipeline_file import load_pipeline
    from dsrecipes.core.errors import UserError
    from dsrecipes.run.pipeline import check_stages

    path = tmp_path / "p.yaml"
    path.write_text("shared:\n  debug: fast\nstages:\n  - name: sft\n  - name: dpo\n    model_from: sft\n"
                    "    set: {objective: dpo, dataset: sample_pairs}\n  - name: grpo\n    model_from: sft\n"
                    "    from_export: {objective.reward_model: dpo}\n    set: {objective: grpo}\n")
    with pytest.raises(UserError) as info:
        check_stages(load_pipeline(path), tmp_path / "out")
    assert info.value.problems == [f"{path}: stage 'grpo' (line 8): from_export objective.reward_model: stage 'dpo' "
                                   "trains objective=dpo, not a reward model (objective=reward)"]
    path.write_text(path.read_text().replace("objective: dpo,", "objective: reward,"))
    check_stages(load_pipeline(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_adapter_export_names_its_local_base_model_by_its_absolute_path(tmp_path, monkeypatch):
    """`model.path=runs/dpo/export model.lora.enabled=true` then `dsrecipes export RUN --lora adapter`: the adapter's
    adapter_config.json said base_model_name_or_path 'runs/dpo/export', so `dsrecipes chat ADAPTER` from any other
    directory said "a LoRA adapter whose base model 'runs/dpo/export' is not a local model directory here"."""
    from types import SimpleNamespace

    from dsrecipes.rank.export import _adapter_base

    (tmp_path / "runs" / "sft" / "export").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for typed, recorded in (("runs/sft/export", str(tmp_path / "runs" / "sft" / "export")), ("Org/Name", "Org/Name")):
        peft = SimpleNamespace(base_model_name_or_path=None)
        cfg = SimpleNamespace(model=SimpleNamespace(path=typed))
        assert _adapter_base(cfg, SimpleNamespace(peft_config={"default": peft}), None, tmp_path) == recorded
        assert peft.base_model_name_or_path == recorded


def test_prompt_eval_says_a_baseline_run_is_its_starting_model(tmp_path, monkeypatch):
    """`prompt-eval --baseline runs/sft --finetuned runs/dpo` (SFT against DPO, as a pipeline's stages read) compared
    DPO with the model SFT *started* from (the tiny model's random start), and said only that this start is random."""
    from types import SimpleNamespace

    from dsrecipes.commands.prompt_eval import started_from_note

    monkeypatch.chdir(tmp_path)
    sft, dpo = tmp_path / "runs" / "sft", tmp_path / "runs" / "dpo"
    for run in (sft, dpo):
        (run / "export").mkdir(parents=True)
        (run / "export" / "config.json").write_text("{}")
    start = SimpleNamespace(path=sft / "export_init", run_dir=sft)
    tuned = SimpleNamespace(path=dpo / "export", run_dir=dpo)
    assert started_from_note("runs/sft", start, tuned) == (
        f"baseline: runs/sft is a run directory, so the model it started from answers ({sft / 'export_init'}); to "
        "compare with the model it trained, give --baseline runs/sft/export")
    assert started_from_note("runs/dpo", SimpleNamespace(path=sft / "export", run_dir=dpo), tuned) is None  # same run
    assert started_from_note("runs/sft/export", SimpleNamespace(path=sft / "export", run_dir=sft), tuned) is None
    assert started_from_note(None, None, tuned) is None


def test_a_shipped_pipeline_runs_by_name_from_any_directory(tmp_path, monkeypatch):
    """README: `dsrecipes pipeline recipes/pipelines/smollm2_chat.yaml`; from any directory but the checkout's root
    (or with `pip install .`) that was 'cannot read (No such file or directory)', and a name was not taken."""
    from dsrecipes.commands.pipeline import pipeline_file
    from dsrecipes.core.errors import UserError
    from dsrecipes.core.paths import shipped_recipes_dir

    monkeypatch.chdir(tmp_path)
    shipped = shipped_recipes_dir() / "pipelines" / "smollm2_chat.yaml"
    assert pipeline_file("smollm2_chat") == shipped
    assert pipeline_file("recipes/pipelines/smollm2_chat.yaml") == shipped
    (tmp_path / "smollm2_chat.yaml").write_text("stages: []\n")  # a file of one's own comes first
    assert pipeline_file("smollm2_chat.yaml") == Path("smollm2_chat.yaml")
    with pytest.raises(UserError, match=r"smollm2_chatt: no such pipeline file; did you mean smollm2_chat\? "
                                        r"\(shipped pipelines, run by name: smollm2_chat, smollm2_chat_grpo, smollm2_dschat_split\)"):
        pipeline_file("smollm2_chatt")
    assert pipeline_file("elsewhere/p.yaml").name == "p.yaml"  # any other path: load_pipeline names it
    from tests.test_readme import README

    assert "runs by its name, from any directory (`dsrecipes pipeline smollm2_chat`)" in README
