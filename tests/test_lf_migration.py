"""A LLaMA-Factory experiment file migrates in one pass (issue 49 item 4): every problem of a flat recipe file in one
run (exit 2), LLaMA-Factory keys answered with our spelling and their value or a "not needed here" note, `stage`
meaning the objective (not zero.stage), and `scheduler.warmup_ratio` validated and used by the schedule."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest

from dsrecipes.cli import main
from dsrecipes.config import recipe_file
from dsrecipes.config.flat_check import flat_problems
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import SchedulerConfig, SchedulerKind
from dsrecipes.rank.schedule import lr_factor, warmup_steps

LF_FILE = """### method
stage: dpo
finetuning_type: lora
do_train: true
### train
warmup_ratio: 0.1
trainer:
  max_steps: 5
"""


def _error(capsys, *argv):
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def test_a_flat_file_with_four_llamafactory_keys_gets_four_messages_in_one_run(tmp_path, capsys):
    recipe = tmp_path / "lf.yaml"
    recipe.write_text(LF_FILE)
    err = _error(capsys, "validate", f"recipe={recipe}")
    assert "error: 4 problems:" in err, err
    assert f"{recipe}:2: stage: LLaMA-Factory's stage is the training objective; here: objective: dpo" in err, err
    assert "zero.stage is DeepSpeed's" in err and "did you mean zero.stage" not in err, err
    assert f"{recipe}:3: finetuning_type: LLaMA-Factory's key; here: model.lora.enabled: true" in err, err
    assert f"{recipe}:4: do_train: not needed here" in err, err
    assert f"{recipe}:6: warmup_ratio: transformers' key (LLaMA-Factory, TRL); here: scheduler.warmup_ratio: 0.1" in err, err


def test_every_kind_of_problem_of_a_file_is_reported_at_once(tmp_path):
    """Unknown keys (ours misspelled, nested, another tool's), a missing option and a wrong type: one ConfigError."""
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("zero: stage9\ntrainer:\n  max_steps: many\n  learning_rate: 1.0e-4\noptimizer.weight_decy: 0.1\n"
                      "dataset: identity,alpaca_en_demo\ncutoff_len: 1024\ntemplate: llama3\nmodel: smollm2_135m\n")
    with pytest.raises(ConfigError) as caught:
        recipe_file.load(recipe)
    problems = caught.value.problems
    assert len(problems) == 6, problems
    text = "\n".join(problems)
    assert f"{recipe}:1: zero=stage9: no option 'stage9'" in text
    assert f"{recipe}:3: trainer.max_steps: expected an integer" in text
    assert f"{recipe}:4: trainer.learning_rate: unknown key; transformers' key (LLaMA-Factory, TRL); here: optimizer.lr: 0.0001" in text
    assert "optimizer.weight_decy: unknown key; did you mean optimizer.weight_decay?" in text
    assert "dataset.use: [identity, alpaca_en_demo] with dataset.registry: DIR/dataset_info.json" in text
    assert f"{recipe}:7: cutoff_len: LLaMA-Factory's key; here: data.cutoff_len: 1024" in text


@pytest.mark.parametrize("key, value, words", [
    ("stage", "rm", "objective: reward"), ("stage", "sft", "objective: sft"),
    ("finetuning_type", "full", "not needed here: full fine-tuning is the default"),
    ("template", "qwen", "template: auto"), ("per_device_train_batch_size", 2, "trainer.micro_batch_size: 2"),
    ("gradient_accumulation_steps", 8, "trainer.grad_accum: 8"), ("learning_rate", 5.0e-6, "optimizer.lr: 5e-06"),
    ("num_train_epochs", 3.0, "trainer.epochs: 3"), ("lora_rank", 16, "model.lora.r: 16"),
    ("lora_target", "q_proj,v_proj", "model.lora.target_modules: [q_proj, v_proj]"),
    ("dataset_dir", "data", "dataset.registry: data/dataset_info.json"), ("output_dir", "out", "trainer.output_dir: out"),
    ("logging_steps", 5, "trainer.log_every: 5"), ("save_steps", 50, "trainer.save_every: 50"),
    ("bf16", True, "precision: bf16"), ("deepspeed", "examples/deepspeed/ds_z3_config.json", "zero: stage3"),
    ("val_size", 0.1, "dataset.val_size: 0.1"), ("model_name_or_path", "/m", "model.path: /m"),
    ("pref_beta", 0.1, "objective.beta: 0.1"), ("pref_loss", "orpo", "objective: orpo"),
    ("pref_loss", "simpo", "objective.loss: simpo"), ("cutoff_len", 512, "data.cutoff_len: 512"),
    ("dataloader_num_workers", 4, "data.num_workers: 4"), ("report_to", "none", "trainer.report_to: []"),
    ("report_to", "wandb", "trainer.report_to: [wandb]"), ("trust_remote_code", True, "stays false here"),
    ("resume_from_checkpoint", None, "not needed here: a run continues from its trainer.output_dir's newest"),
])  # fmt: skip
def test_llamafactory_keys_get_our_spelling(key, value, words):
    (problem,) = flat_problems({key: value}, "f.yaml", lambda _: None)
    assert problem.startswith(f"f.yaml: {key}") and words in problem, problem


def test_the_shipped_recipes_have_no_flat_problems():
    for path in glob.glob(str(Path(__file__).resolve().parents[1] / "recipes" / "*.yaml")):
        recipe_file.load(Path(path))  # raises ConfigError listing the problems


@pytest.mark.parametrize("typed, words, not_words", [
    ("template=qwen", "LLaMA-Factory's qwen template is chatml plus its default system prompt 'You are Qwen, created by "
     "Alibaba Cloud. You are a helpful assistant.', put in every conversation without one (chatml alone puts none); "
     "here: template: chatml with template.default_system: 'You are Qwen", "options:"),
    ("template=yi", "LLaMA-Factory's yi template is chatml; here: template: chatml, or template: auto", "options:"),
    ("template=llama2", "the model's own format; here: template: auto", "did you mean llama3"),  # not a typo
    ("template=default", "template: human_assistant", "did you mean"),
    ("template=chatlm", "did you mean chatml?", "LLaMA-Factory"),  # our own name misspelled: the typo wins
    ("dataset=my_chats", "here: dataset.use: [my_chats] with dataset.registry: DIR/dataset_info.json", "options:"),
    ("dataset=sampel", "did you mean sample?", "LLaMA-Factory"),
    ("finetuning_type=lora", "finetuning_type: LLaMA-Factory's key; here: model.lora.enabled: true", "did you mean"),
    ("lr_scheduler_type=linear", "here: scheduler: linear", "NAME"), ("deepspeed=ds_z2_config.json", "zero: stage2", "N?"),
    ("model=smollm2", "did you mean smollm2_135m?", "LLaMA"), ("model=qwen2.5", "did you mean qwen2_5_0_5b?", "LLaMA"),
    ("objective=rm", "LLaMA-Factory's rm; here: objective: reward", "options:"),
    ("objective=ppo", "here: objective: grpo (online RL; there is no PPO here)", "did you mean dpo"),
    ("objective=simpo", "here: objective: dpo with objective.loss: simpo", "options:"),
    ("zero=3", "zero=3: no option '3' in group 'zero'; did you mean stage3?", "Got int"),  # was Hydra's words alone
    ("offload=cpu", "did you mean cpu_optimizer or cpu_optimizer_params?", "LLaMA"),
])  # fmt: skip
def test_llamafactory_names_on_the_command_line_get_our_spelling_with_the_value(capsys, typed, words, not_words):
    """A group option that is LLaMA-Factory's name (a template, a dataset_info.json entry) and a key whose value
    decides our spelling: the line a file gets, not a "did you mean" that leads to `model.lora.enabled=lora`."""
    err = _error(capsys, "validate", typed)
    assert words in err and not_words not in err, err


def test_a_llamafactory_template_name_in_a_file_is_not_taken_for_a_typo():
    (problem,) = flat_problems({"template": "llama2"}, "f.yaml", lambda _: None)
    assert "template: auto" in problem and "llama3" not in problem, problem
    (problem,) = flat_problems({"zero": 3}, "f.yaml", lambda _: None)  # was "expected a mapping for ZeroConfig"
    assert problem == "f.yaml: zero=3: no option '3' in group 'zero'; did you mean stage3? (options: stage0, stage1, " \
        "stage2, stage3)", problem


def test_epochs_under_a_step_budget_is_a_warning(make_cfg):
    """`trainer.epochs=3` (num_train_epochs' spelling here) trained the default 400 steps without a word."""
    from dsrecipes.config.defaults import config_warnings

    (warning,) = config_warnings(make_cfg("trainer.epochs=3"))
    assert warning == "trainer.epochs: 3 is unused: trainer.max_steps=400 sets the run's length; " \
        "trainer.max_steps=null trains 3 epochs"
    assert config_warnings(make_cfg("trainer=full_epochs")) == config_warnings(make_cfg()) == []
    (problem,) = flat_problems({"num_train_epochs": 2.0}, "f.yaml", lambda _: None)
    assert "trainer.epochs: 2 with trainer.max_steps: null" in problem, problem


def test_stage_on_the_command_line_means_the_objective(capsys):
    err = _error(capsys, "validate", "stage=dpo")
    assert "objective: dpo" in err and "did you mean zero.stage" not in err, err


@pytest.mark.parametrize("ratio", ["-0.1", "1.0"])
def test_warmup_ratio_outside_0_1_is_refused_naming_the_key(capsys, ratio):
    err = _error(capsys, "validate", f"scheduler.warmup_ratio={ratio}")
    assert "scheduler.warmup_ratio: must be in [0, 1)" in err, err


def test_warmup_ratio_sets_the_warmup_of_the_schedule_and_wins_over_warmup_steps():
    cfg = SchedulerConfig(name=SchedulerKind.constant, warmup_steps=3, warmup_ratio=0.1)
    assert warmup_steps(cfg, 100) == (10, None)
    assert lr_factor(cfg, 5, 100) == pytest.approx(0.5)  # halfway through ceil(0.1 x 100) = 10 warmup steps
    assert lr_factor(cfg, 10, 100) == 1.0
    assert warmup_steps(SchedulerConfig(warmup_ratio=0.05), 30)[0] == 2  # ceil(1.5), as Hugging Face rounds
    assert warmup_steps(SchedulerConfig(warmup_ratio=0.0, warmup_steps=10), 30)[0] == 0
    assert lr_factor(SchedulerConfig(name=SchedulerKind.constant), 5, 100) == pytest.approx(0.5)  # unset: 10 steps


@pytest.mark.parametrize("argv, said", [
    (["train", "--config", "my.yaml"], "unrecognized arguments: --config; a recipe file is given by its path: "
                                       "dsrecipes train FILE.yaml"),  # (was: ambiguous option, --config-path ...)
    (["train", "-c", "my.yaml"], "a recipe file is given by its path: dsrecipes train FILE.yaml"),
    (["train", "--learning_rate", "1e-4"], "--learning_rate is another tool's flag: here the override optimizer.lr="),
    (["validate", "--per-device-train-batch-size", "4"], "here the override trainer.micro_batch_size=VALUE"),
])
def test_another_tools_flags_say_what_to_write_here(capsys, argv, said):
    assert said in _error(capsys, *argv)
