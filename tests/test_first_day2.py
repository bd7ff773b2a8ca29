"""A LLaMA-Factory user's first day, second pass (played on a CPU machine from a scratch directory): what they typed,
following the README and the migration messages literally, and what it answered."""

from __future__ import annotations

import pytest

from dsrecipes.cli import main


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out + captured.err


def test_the_epochs_migration_message_written_into_a_recipe_file_is_accepted(tmp_path, capsys):
    """`num_train_epochs: 3` answers 'here: trainer.epochs: 3 with trainer.max_steps: null'; written into the file as
    said, `trainer.max_steps: null` was refused ('must not be null (expected int)') though the command line's
    trainer.max_steps=null and conf/trainer/full_epochs.yaml take it. A non-Optional key's null is still refused."""
    recipe = tmp_path / "lf.yaml"
    recipe.write_text("num_train_epochs: 3.0\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 2 and "trainer.epochs: 3 with trainer.max_steps: null" in said, said
    recipe.write_text("trainer.epochs: 3\ntrainer.max_steps: null\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 0, said
    recipe.write_text("trainer:\n  epochs: 3\n  max_steps: null\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 0, said
    recipe.write_text("trainer.micro_batch_size: null\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 2 and "trainer.micro_batch_size: must not be null" in said, said


def test_a_finished_epoch_based_run_is_told_to_raise_its_epochs():
    """A finished `trainer.max_steps: null, trainer.epochs: 3` run (LLaMA-Factory's num_train_epochs) resumed with the
    same budget was told 'raise trainer.max_steps above 81 (e.g. trainer.max_steps=162)': a key the user never wrote,
    which turns the run from epochs into steps. Now it names trainer.epochs first (tried: trainer.epochs=4 resumes at
    step 81 and trains epoch 4); a step-budget run keeps the step advice."""
    from dsrecipes.core.errors import Refused
    from dsrecipes.run.resume_contract import check_budget

    epochs = {"trainer": {"max_steps": None, "epochs": 3}}
    with pytest.raises(Refused) as refused:
        check_budget("step_81", 81, 81, {}, epochs, epochs, finished=True)
    assert "raise trainer.epochs above 3 (e.g. trainer.epochs=6), or set trainer.max_steps above 81" in str(
        refused.value), refused.value
    steps = {"trainer": {"max_steps": 400, "epochs": 1}}
    with pytest.raises(Refused) as refused:
        check_budget("step_400", 400, 400, {}, steps, steps, finished=True)
    assert "raise trainer.max_steps above 400 (e.g. trainer.max_steps=800)" in str(refused.value), refused.value


def test_a_zero3_export_keeps_deepspeeds_consolidation_narrative_in_the_log(tmp_path, monkeypatch, capsys):
    """A ZeRO-3 run's export (tried: an LF-style LoRA + zero: stage3 recipe, launcher=local) printed DeepSpeed's
    zero_to_fp32 narrative between the last step and the summary: 'Processing zero checkpoint ...', 'Parsing checkpoint
    created by deepspeed==...', 'Detected checkpoint of type ...', 'Reconstructed Trainable fp32 state dict ...' and two
    tqdm bars ('Loading checkpoint shards', 'Gathering sharded weights'). Now they go to the run's log."""
    import sys
    import types

    from dsrecipes.core import console
    from dsrecipes.rank.export import consolidated_state_dict

    def narrating(ckpt_dir, tag, exclude_frozen_parameters):  # zero_to_fp32's own output, as it writes it
        print(f"Processing zero checkpoint '{ckpt_dir}/{tag}'")
        sys.stderr.write("Gathering sharded weights:   0%|          | 0/28\rGathering sharded weights: 100%|###| 28/28\n")
        print("Reconstructed Trainable fp32 state dict with 28 params 37376 elements")
        return {"w": 1}

    fake = types.ModuleType("deepspeed.utils.zero_to_fp32")
    fake.get_fp32_state_dict_from_zero_checkpoint = narrating
    monkeypatch.setitem(sys.modules, "deepspeed.utils.zero_to_fp32", fake)
    log = tmp_path / "logs" / "main.log"
    log.parent.mkdir()
    monkeypatch.setattr(console._SINK, "path", log)

    class Checked:
        def guard(self):
            import contextlib

            return contextlib.nullcontext()

    assert consolidated_state_dict(tmp_path / "checkpoints" / "step_81", 3, checked=Checked()) == {"w": 1}
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "", captured
    kept = log.read_text()
    assert "Processing zero checkpoint" in kept and "Reconstructed Trainable" in kept, kept
    assert "Gathering sharded weights: 100%" in kept, kept
    print("after")  # the console is ours again
    assert capsys.readouterr().out == "after\n"


@pytest.mark.parametrize("key, value", [
    ("train_on_prompt", True), ("mask_history", True), ("neat_packing", True), ("buffer_size", 128),
    ("default_system", "Be brief."), ("adam_beta1", 0.8), ("adam_beta2", 0.95), ("adam_epsilon", 1.0e-6),
    ("lr_scheduler_kwargs", {"min_lr_rate": 0.1}), ("eval_on_start", False), ("disable_gradient_checkpointing", False),
    ("early_stopping_steps", 3),
])  # fmt: skip
def test_more_llamafactory_keys_get_a_line_that_validates_as_written(tmp_path, capsys, key, value):
    """LLaMA-Factory keys an LF user's file has (tried: a 45-key file) were 'unknown key (keys of the config: data,
    dataset, launcher, ...)' - no word of ours: train_on_prompt, mask_history, neat_packing, buffer_size, adam_beta1/2,
    adam_epsilon, lr_scheduler_kwargs, disable_gradient_checkpointing (default_system and eval_on_start: a 'did you
    mean' without the value). Now each gets 'here: KEY: VALUE', and that line, written into a file, validates."""
    import re

    from dsrecipes.config.flat_check import flat_problems

    (problem,) = flat_problems({key: value}, "f.yaml", lambda _: None)
    found = re.search(r"(?:LLaMA-Factory's|transformers') key(?: \(LLaMA-Factory, TRL\))?; here: ([\w.]+): (.+?)(?: \(|$)",
                      problem)
    assert found, problem
    recipe = tmp_path / "ours.yaml"
    recipe.write_text(f"{found.group(1)}: {found.group(2)}\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 0, (problem, said)


@pytest.mark.parametrize("key, value, words", [
    ("mix_strategy", "interleave_under", "weight"), ("interleave_probs", "0.5,0.5", "dataset.sources[i].weight"),
    ("use_dora", True, "no DoRA here"), ("new_special_tokens", "<a>", "no new special tokens here"),
    ("resize_vocab", True, "not needed here"), ("run_name", "x", "trainer.output_dir names the run"),
    ("export_dir", "out/m", "dsrecipes export RUN --out out/m"), ("pure_bf16", True, "precision: bf16"),
    ("disable_gradient_checkpointing", True, "not needed here: model.gradient_checkpointing: false is the default"),
    ("lr_scheduler_type", "cosine_with_min_lr", "scheduler: cosine with scheduler.min_lr_ratio"),
    ("include_num_input_tokens_seen", True, "samples_seen"), ("use_fast_tokenizer", True, "AutoTokenizer"),
    ("dataloader_pin_memory", False, "offload.pin_memory"),
    ("enable_thinking", False, "remove the <think>...</think> part from the answers in your data"),
    ("enable_thinking", True, "keep the <think>...</think> part in the answers of your data, with template: auto"),
])  # fmt: skip
def test_llamafactory_keys_without_a_twin_say_what_to_do_instead(key, value, words):
    from dsrecipes.config.flat_check import flat_problems

    (problem,) = flat_problems({key: value}, "f.yaml", lambda _: None)
    assert words in problem and "unknown key" not in problem, problem


LF_SFT = """### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all
### dataset
dataset: my_chats
dataset_dir: data
template: qwen
cutoff_len: 256
overwrite_cache: true
quantization_bit: 4
### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
val_size: 0.1
deepspeed: examples/deepspeed/ds_z3_config.json
zero: stage3
"""


def test_a_llamafactory_file_is_printed_in_our_keys_and_that_file_validates(tmp_path, capsys):
    """An LF user's file got one line per key (22 here) to apply by hand, each with its own wording. Now the problems
    are followed by the whole file in our keys - translated, not-needed keys dropped, a key without a twin kept as a
    `#` line - and that text, saved as a file, validates (the registry entry exists). Nothing is written to disk."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chats.json").write_text(
        '[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]\n' * 1)
    (tmp_path / "data" / "dataset_info.json").write_text('{"my_chats": {"file_name": "chats.json"}}')
    recipe = tmp_path / "lf.yaml"
    recipe.write_text(LF_SFT)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 2 and f"{recipe} in our keys (`#` lines: see their problem above):\n" in said, said
    ours = said.split(f"{recipe} in our keys (`#` lines: see their problem above):\n", 1)[1]
    assert "do_train" not in ours and "overwrite_cache" not in ours, ours
    assert "# quantization_bit: 4\n" in ours and "template: chatml\n" in ours and "zero: stage3\n" in ours, ours
    assert "model.lora.target_modules: [all-linear]\n" in ours
    assert "trainer.epochs: 3\ntrainer.max_steps: null\n" in ours and "dataset.use: [my_chats]\n" in ours, ours
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    (tmp_path / "ours.yaml").write_text(ours)
    code, said = _run(capsys, "validate", f"recipe={tmp_path / 'ours.yaml'}", "dataset.registry="
                      f"{tmp_path / 'data' / 'dataset_info.json'}")
    assert code == 0, (ours, said)


def test_a_file_of_our_own_keys_with_a_typo_gets_no_translation(tmp_path, capsys):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("optimizer.weight_decy: 0.1\ntrainer:\n  max_steps: many\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 2 and "in our keys" not in said, said


def test_llamafactorys_chat_and_export_files_get_the_command_to_type_here(tmp_path, capsys):
    """`llamafactory-cli chat infer.yaml` / `export merge.yaml` habits: `dsrecipes chat infer.yaml` said 'not a run
    directory, a Hugging Face model directory (config.json) or a LoRA adapter export' and `dsrecipes export merge.yaml`
    'the following arguments are required: --out' - neither said what to type. Now both name the command, from the
    file's adapter_name_or_path and export_dir; anything else keeps its message."""
    infer = tmp_path / "infer.yaml"
    infer.write_text("model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct\nadapter_name_or_path: saves/sft\n"
                     "template: llama3\n")
    code, said = _run(capsys, "chat", str(infer))
    assert code == 2 and "a LLaMA-Factory chat file" in said and "dsrecipes chat saves/sft (" in said, said
    merge = tmp_path / "merge.yaml"
    merge.write_text("model_name_or_path: m\nadapter_name_or_path: saves/sft\nexport_dir: out/merged\n")
    code, said = _run(capsys, "export", str(merge))
    assert code == 2 and "dsrecipes export saves/sft --out out/merged" in said, said
    other = tmp_path / "other.yaml"
    other.write_text("trainer.max_steps: 5\n")
    code, said = _run(capsys, "chat", str(other))
    assert code == 2 and "not a run directory" in said, said


def test_show_says_that_named_data_replaces_the_sample_it_lists(tmp_path, capsys):
    """`dsrecipes show` with dataset.use printed `dataset: name: sample, paths: [.../sample_data/train.jsonl]` and
    nothing else about the data: an LF user read it as training on the sample. Now a line under the config says
    what a run reads; without named data there is no such line."""
    code, said = _run(capsys, "show", f"dataset.registry={tmp_path / 'dataset_info.json'}", "dataset.use=[mine]")
    assert code == 0 and "# data: a run reads dataset.use, not the bundled sample" in said, said
    code, said = _run(capsys, "show")
    assert code == 0 and "# data:" not in said


def test_a_translated_lora_file_keeps_llamafactorys_lora_defaults(tmp_path, capsys):
    """LLaMA-Factory's LoRA, where the file is silent, targets every linear layer with alpha 2 x rank and no dropout;
    ours q/k/v/o_proj, alpha 16, dropout 0.05. A translated `finetuning_type: lora, lora_rank: 16` file silently trained
    another adapter (a quarter of the layers, half the scale). Now the translation writes LF's values where the file
    was silent and the finetuning_type line says why; keys the file sets are its own."""
    from dsrecipes.config.lf_translate import in_our_keys

    ours = in_our_keys({"finetuning_type": "lora", "lora_rank": 16}, {"finetuning_type": "x", "lora_rank": "x"})
    assert "model.lora.alpha: 32\n" in ours and "model.lora.dropout: 0.0\n" in ours, ours
    assert "model.lora.target_modules: [all-linear]\n" in ours, ours
    ours = in_our_keys({"finetuning_type": "lora", "lora_alpha": 8, "lora_dropout": 0.1, "lora_target": "q_proj"},
                       {"finetuning_type": "x", "lora_alpha": "x", "lora_dropout": "x", "lora_target": "x"})
    assert ours.count("model.lora.alpha") == 1 and "model.lora.alpha: 8\n" in ours, ours
    assert "model.lora.dropout: 0.1\n" in ours and "model.lora.target_modules: [q_proj]\n" in ours, ours
    recipe = tmp_path / "lf.yaml"
    recipe.write_text("finetuning_type: lora\n")
    code, said = _run(capsys, "validate", f"recipe={recipe}")
    assert code == 2 and "lora_alpha: 2 x lora_rank" in said and "model.lora.alpha: 16\n" in said, said


def test_the_top_level_help_points_a_llamafactory_user_at_the_migration(capsys):
    """`dsrecipes --help` (the first thing typed) said nothing of LLaMA-Factory files; the README's pointer was the only
    way in. Now one line names the command that translates such a file."""
    code, said = _run(capsys, "--help")
    assert code == 0 and "From LLaMA-Factory: `dsrecipes validate recipe=YOUR_LF.yaml`" in said, said


def test_the_train_further_command_of_an_epoch_based_run_trains_more_epochs(tmp_path, monkeypatch, capsys):
    """The closing summary's `train further:` of a finished `trainer.max_steps=null trainer.epochs=1` run (LLaMA-
    Factory's num_train_epochs) dropped trainer.max_steps and gave no new budget: copied, it was refused ('the run
    already reached its budget') or, without the null, trained to the default 400 steps. Now it says
    `trainer.max_steps=null trainer.epochs=2`, and run as printed it trains the second epoch."""
    import shlex

    from dsrecipes.cli import main
    from dsrecipes.core.rundir import read_metrics
    from tests.conftest import in_process_environ

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    argv = ["debug=fast", "trainer.max_steps=null", "trainer.epochs=1", "dataset.max_samples=48",
            "trainer.eval_every=0", "trainer.save_every=0", f"trainer.output_dir={run}"]
    with in_process_environ():
        assert main(argv) == 0
    out = capsys.readouterr().out
    (line,) = [s for s in out.splitlines() if s.strip().startswith("train further:")]
    printed = shlex.split(line.split("train further:", 1)[1])
    assert printed[-2:] == ["trainer.max_steps=null", "trainer.epochs=2"], printed
    first = max(r["step"] for r in read_metrics(run) if "loss" in r)
    with in_process_environ():
        assert main(printed[1:]) == 0, capsys.readouterr().err
    assert max(r["step"] for r in read_metrics(run) if "loss" in r) == 2 * first
