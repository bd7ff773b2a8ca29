"""A TRL user's first day: SFTConfig/DPOConfig/GRPOConfig keys and TRL's LoRA keys (ModelConfig) in a recipe file or
on the command line are answered with our key and their value, or what to write instead (config/trl_keys.py), and
the file is printed in our keys with TRL's meaning kept (TRL's defaults where the file is silent and ours differ)."""

from __future__ import annotations

from dsrecipes.cli import main

TRL_SFT = """model_name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct
max_length: 256
assistant_only_loss: false
use_peft: true
lora_target_modules: [q_proj, v_proj]
dataset_text_field: text
"""


def _error(capsys, *argv):
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def test_a_trl_sft_file_gets_our_keys_with_trl_meaning(tmp_path, capsys):
    recipe = tmp_path / "trl_sft.yaml"
    recipe.write_text(TRL_SFT)
    err = _error(capsys, "validate", f"recipe={recipe}")
    assert f"{recipe}:2: max_length: TRL's key; here: data.cutoff_len: 256" in err, err
    assert f"{recipe}:3: assistant_only_loss: TRL's key; here: data.train_on: all" in err, err
    assert f"{recipe}:4: use_peft: TRL's key; here: model.lora.enabled: true" in err, err
    assert f"{recipe}:5: lora_target_modules: TRL's key; here: model.lora.target_modules: [q_proj, v_proj]" in err, err
    assert f"{recipe}:6: dataset_text_field: no plain-text (language-modeling) rows here" in err, err
    ours = err.split("in our keys")[1]
    for line in ("data.cutoff_len: 256", "data.train_on: all", "model.lora.enabled: true", "model.lora.r: 16",
                 "model.lora.alpha: 32", "model.lora.target_modules: [q_proj, v_proj]", "# dataset_text_field: text"):
        assert f"\n{line}\n" in ours, ours


def test_trl_names_on_the_command_line_name_our_key(capsys):
    assert "max_length: unknown key; did you mean data.cutoff_len?" in _error(capsys, "validate", "max_length=512")
    assert "seed: unknown key; did you mean trainer.seed?" in _error(capsys, "validate", "seed=1")
    assert "loss_type: TRL's key; here: objective.loss: ipo" in _error(capsys, "validate", "loss_type=ipo")
    err = _error(capsys, "validate", "precompute_ref_log_probs=false")
    assert "precompute_ref_log_probs: TRL's key; here: objective.reference: live" in err, err
    assert "max_prompt_length: no prompt cap of its own here (128)" in _error(capsys, "validate", "max_prompt_length=128")


def test_max_steps_wins_over_num_train_epochs_in_the_translated_file_whatever_their_order(tmp_path, capsys):
    """transformers' Trainer (TRL's, LLaMA-Factory's) trains max_steps when it is > 0 and num_train_epochs when it is
    -1 (its default). Was: `num_train_epochs: 1` before `max_steps: 4` printed `trainer.max_steps: null` (a full
    epoch), and `max_steps: -1` printed `trainer.max_steps: -1` (refused by validation)."""
    recipe = tmp_path / "steps.yaml"
    recipe.write_text("num_train_epochs: 1\nmax_steps: 4\n")
    err = _error(capsys, "validate", f"recipe={recipe}")
    assert "but this file's max_steps: 4 wins over it" in err, err
    assert err.split("in our keys")[1].split("\n", 1)[1] == "trainer.epochs: 1\ntrainer.max_steps: 4\n", err
    recipe.write_text("max_steps: -1\n")
    ours = _error(capsys, "validate", f"recipe={recipe}").split("in our keys")[1].split("\n", 1)[1]
    assert ours == "trainer.max_steps: null\ntrainer.epochs: 3\n", ours


def test_a_key_only_another_objective_reads_is_refused_not_ignored(capsys):
    """A TRL DPOConfig/GRPOConfig file says its objective by the trainer, not by a key: translated, its beta and
    loss_type (objective.beta, objective.loss) without `objective: dpo` trained SFT and read neither. Now each such
    key names the objectives that read it (config/objective_rules.READ_BY)."""
    err = _error(capsys, "validate", "objective.beta=0.3", "objective.loss=ipo")
    assert "objective.beta: only objective=dpo or objective=orpo or objective=grpo reads it, and this run is " \
           "objective=sft (the default)" in err, err
    assert "objective.loss: only objective=dpo reads it" in err, err
    err = _error(capsys, "validate", "objective=dpo", "dataset=sample_pairs", "objective.num_generations=8")
    assert "objective.num_generations: only objective=grpo reads it, and this run is objective=dpo:" in err, err
    assert main(["validate", "objective=dpo", "dataset=sample_pairs", "objective.beta=0.3", "objective.loss=ipo"]) == 0


def test_trl_implicit_prompt_pairs_prepare_as_the_same_pairs_with_an_explicit_prompt(tmp_path):
    """TRL's preference rows without a `prompt` column (chosen/rejected whole conversations sharing their first
    messages: RewardTrainer's usual rows, trl.data_utils.extract_prompt) stopped at line 1 with 'missing_conversation
    (no 'prompt' field ...)'. Now the shared messages are the prompt, as TRL splits them."""
    from tests.test_trl_rows import QUESTIONS, _assistant, _prepared, _same_rows, _user

    system = [{"role": "system", "content": "Be brief."}]
    explicit = [{"prompt": system + _user(q), "chosen": _assistant(f"It is {2 * i + 1}."),
                 "rejected": _assistant("I do not know.")} for i, q in enumerate(QUESTIONS)]
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"], "score_chosen": 9.0}
                for r in explicit]
    a = _prepared(tmp_path, "implicit", implicit, "objective=reward")
    b = _prepared(tmp_path, "explicit", explicit, "objective=reward")
    _same_rows(a, b, len(QUESTIONS))


def test_trl_grpo_batch_size_counts_completions_and_translates_to_prompts(tmp_path, capsys):
    """TRL's GRPOConfig per_device_train_batch_size counts completions (whole groups of num_generations); ours counts
    prompts, each sampled objective.num_generations times. Was: `per_device_train_batch_size: 8` with
    `num_generations: 4` -> trainer.micro_batch_size: 8 (32 completions per micro-batch, 4x TRL's)."""
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("per_device_train_batch_size: 8\nnum_generations: 4\n")
    err = _error(capsys, "validate", f"recipe={recipe}")
    assert "under TRL's GRPO per_device_train_batch_size counts completions" in err, err
    ours = err.split("in our keys")[1].split("\n", 1)[1]
    assert ours == "trainer.micro_batch_size: 2\nobjective: grpo\nobjective.num_generations: 4\n", ours
    recipe.write_text("per_device_train_batch_size: 6\nnum_generations: 4\n")
    ours = _error(capsys, "validate", f"recipe={recipe}").split("in our keys")[1]
    assert "# per_device_train_batch_size: 6\n" in ours, ours


def test_transformers_warmup_is_translated_with_its_meaning(tmp_path, capsys):
    """transformers (TRL's TrainingArguments base) warms up for warmup_steps, 0 by default, and since 5.0 reads a
    float below 1 as a share of the steps. Was: `warmup_steps: 0.03` -> scheduler.warmup_steps: 0.03 (refused: an
    integer), and `lr_scheduler_type: constant` alone -> scheduler: constant, which warms up over 10 steps here."""
    recipe = tmp_path / "warmup.yaml"
    recipe.write_text("warmup_steps: 0.03\nlr_scheduler_type: linear\n")
    ours = _error(capsys, "validate", f"recipe={recipe}").split("in our keys")[1].split("\n", 1)[1]
    assert ours == "scheduler.warmup_ratio: 0.03\nscheduler: linear\n", ours
    recipe.write_text("lr_scheduler_type: constant\n")
    err = _error(capsys, "validate", f"recipe={recipe}")
    assert "without warmup_steps transformers' schedule starts at the peak" in err, err
    assert err.split("in our keys")[1].split("\n", 1)[1] == "scheduler: constant\nscheduler.warmup_steps: 0\n", err


def test_eval_strategy_no_trains_every_row(tmp_path, capsys):
    """transformers' `eval_strategy: no` (TRL without an eval_dataset) evaluates nothing and trains every row. Was:
    'not needed here: evaluation runs every trainer.eval_every steps' and the translated file dropped it, so
    dataset.val_size (64 rows, or 1% for openai_messages) was held out of training silently."""
    recipe = tmp_path / "noeval.yaml"
    recipe.write_text("eval_strategy: no\n")  # YAML reads a bare `no` as false
    err = _error(capsys, "validate", f"recipe={recipe}")
    assert "eval_strategy: transformers' eval_strategy: no evaluates nothing; here: dataset.val_size: 0" in err, err
    assert err.split("in our keys")[1].split("\n", 1)[1] == "dataset.val_size: 0\n", err
    recipe.write_text("eval_strategy: steps\nval_size: 0.1\n")
    ours = _error(capsys, "validate", f"recipe={recipe}").split("in our keys")[1].split("\n", 1)[1]
    assert ours == "dataset.val_size: 0.1\n", ours


def test_more_trl_keys_say_what_is_here(tmp_path, capsys):
    """Was 'unknown key (keys of the config: ...)' for each; report_to: all became trainer.report_to: [all] (refused)."""
    for override, said in (("rpo_alpha=1.0", "no SFT term in objective=dpo here"), ("use_vllm=true", "no vLLM here"),
                           ("scale_rewards=none", "no scale_rewards: none here"), ("top_p=0.9", "no top_p here"),
                           ("report_to=all", "transformers' report_to: all (every installed integration) has no twin")):
        err = _error(capsys, "validate", override)
        assert f"{override.split('=')[0]}: {said}" in err, err
    recipe = tmp_path / "all.yaml"
    recipe.write_text("report_to: all\nlearning_rate: 1.0e-5\n")
    ours = _error(capsys, "validate", f"recipe={recipe}").split("in our keys")[1].split("\n", 1)[1]
    assert ours == "# report_to: all\noptimizer.lr: 1.0e-05\n", ours


def test_trl_grpo_solution_column_is_the_reference_answer(tmp_path):
    """TRL's GRPO reward functions read a `solution` column (trl.rewards.accuracy_reward(completions, solution)).
    Was: prompt rows with `solution` and no `reference`/`answer` prepared with no reference, so exact_match and
    number_equal rewarded every completion 0 (no learning signal) and nothing said why."""
    from tests.test_trl_rows import QUESTIONS, _prepared, _user

    grpo = ("objective=grpo", "objective.max_completion_length=8", "objective.num_generations=2")
    rows = [{"prompt": _user(q), "solution": str(2 * i + 1)} for i, q in enumerate(QUESTIONS)]
    assert _prepared(tmp_path, "solution", rows, *grpo)["reference"] == [r["solution"] for r in rows]


def test_a_trl_file_translates_with_the_objective_its_trainer_picks(tmp_path, capsys):
    """TRL picks the objective by its trainer class, so a DPOConfig/GRPOConfig file names none. Was: its translation
    had no `objective:` line, and the saved file trained SFT (now refused by READ_BY, but still not runnable as
    printed). Now the first key only one trainer reads brings `objective: <it>`; a file naming its objective keeps it."""
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("learning_rate: 1.0e-6\nnum_generations: 4\nmax_completion_length: 32\n")
    err = _error(capsys, "validate", f"recipe={recipe}")
    assert "a key of TRL's grpo trainer, which picks the objective: objective: grpo" in err, err
    ours = err.split("in our keys")[1].split("\n", 1)[1]
    assert ours == ("optimizer.lr: 1.0e-06\nobjective: grpo\nobjective.num_generations: 4\n"
                    "objective.max_completion_length: 32\n"), ours
    recipe.write_text("precompute_ref_log_probs: true\nbeta: 0.2\n")
    ours = _error(capsys, "validate", f"recipe={recipe}").split("in our keys")[1].split("\n", 1)[1]
    assert ours == "objective: dpo\nobjective.beta: 0.2\n", ours
    recipe.write_text("objective: orpo\nnum_generations: 4\n")
    assert "objective: grpo" not in _error(capsys, "validate", f"recipe={recipe}")


def test_transformers_keys_are_labelled_as_transformers_not_llamafactory_alone():
    """A TRL user's learning_rate / per_device_train_batch_size / gradient_accumulation_steps / bf16 are transformers'
    TrainingArguments, which LLaMA-Factory shares: was labelled "LLaMA-Factory's key" for them too."""
    from dsrecipes.config.foreign_keys import foreign_key

    for key, value, ours in (("learning_rate", 1e-5, "optimizer.lr: 1e-05"), ("bf16", True, "precision: bf16"),
                             ("per_device_train_batch_size", 4, "trainer.micro_batch_size: 4"),
                             ("gradient_accumulation_steps", 2, "trainer.grad_accum: 2")):
        assert foreign_key(key, value).startswith(f"transformers' key (LLaMA-Factory, TRL); here: {ours}"), key
    assert foreign_key("cutoff_len", 64).startswith("LLaMA-Factory's key; here: data.cutoff_len: 64")
    assert foreign_key("max_length", 64).startswith("TRL's key; here: data.cutoff_len: 64")
