"""Red-team of the trust boundary (a shared recipe, pipeline file, model directory or checkpoint handed over by
someone else), each attack tried for real through the CLI: what was still open after the earlier rounds."""

from __future__ import annotations

import pytest

from dsrecipes.cli import main as cli_main


@pytest.mark.parametrize("value", ["${trainer.experiment}", "${now:/tmp/dsr-elsewhere-run}", "${dsr.asset:run}"])
def test_a_shared_recipes_run_directory_cannot_reach_outside_through_an_interpolation(value, tmp_path, monkeypatch,
                                                                                       capsys):
    # Was: trainer.output_dir was judged on its text, relative and without '..', so the run (config.yaml,
    # checkpoints, the export) was written to /tmp/dsr-elsewhere-run or into the installed package.
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f"trainer:\n  experiment: /tmp/dsr-elsewhere-run\n  output_dir: '{value}'\n", encoding="utf-8")
    assert cli_main(["validate", f"recipe={recipe}", "debug=fast"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"trainer.output_dir: set by {recipe}:3, a shared recipe" in err, err
    assert "Traceback" not in err


def test_a_shared_recipes_interpolated_run_directory_inside_the_working_one_is_accepted(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text("trainer:\n  experiment: abc\n  output_dir: runs/${now:%H}/${trainer.experiment}\n",
                      encoding="utf-8")
    assert cli_main(["validate", f"recipe={recipe}", "debug=fast"]) == 0, capsys.readouterr().err


DEEP = '{"a": ' + "[" * 100000 + "]" * 100000 + "}"


def _deep_safetensors(path):
    header = DEEP.encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json", "model.safetensors",
                                  "dsrecipes_export.json"])
def test_a_shared_model_directorys_json_nested_too_deeply_is_one_message(name, model_dir, tmp_path, capsys):
    # Was: json.loads' RecursionError (config.json, tokenizer_config.json and a safetensors header read by the
    # preflight and auto_map checks, an export's marker read by chat) ended validate and chat in a traceback, exit 1.
    # generation_config.json passed validate and failed every rank of train (transformers' own json.loads).
    import shutil

    from tests.test_messages_hostile import refused

    model = tmp_path / "shared"
    shutil.copytree(model_dir, model)
    if name.endswith(".safetensors"):
        _deep_safetensors(model / name)
    else:
        (model / name).write_text(DEEP, encoding="utf-8")
    refused(capsys, ["chat", str(model), "--message", "hi", "--max-new-tokens", "2"], f"{model / name}", "too deeply")
    if name != "dsrecipes_export.json":
        refused(capsys, ["validate", "debug=fast", f"model.path={model}"], f"model.path: {model / name}", "too deeply")


def test_a_model_directorys_settings_file_over_the_bound_is_never_read_whole(model_dir, tmp_path, capsys, monkeypatch):
    import shutil

    import dsrecipes.core.tokenizer as tokenizer_module
    from tests.test_messages_hostile import refused

    model = tmp_path / "shared"
    shutil.copytree(model_dir, model)
    monkeypatch.setattr(tokenizer_module, "MAX_JSON_BYTES", 64)
    refused(capsys, ["validate", "debug=fast", f"model.path={model}"], f"{model / 'config.json'}", "larger than 64 bytes")


def test_a_foreign_commit_record_nested_too_deeply_is_one_message(tmp_path, monkeypatch, capsys):
    # Was: core/checkpoint_names.read_record handed complete.json to json.loads unbounded: train with
    # trainer.resume_from=RUN and export RUN ended in json's RecursionError traceback, exit 1, trusted or not.
    monkeypatch.setenv("DSRECIPES_KEY_FILE", str(tmp_path / "key" / "checkpoint.key"))
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "foreign"
    tag = run / "checkpoints" / "step_8"
    tag.mkdir(parents=True)
    (run / "config.yaml").write_text("trainer:\n  max_steps: 8\n", encoding="utf-8")
    (tag / "complete.json").write_text(DEEP, encoding="utf-8")
    for trusted in ([], ["--trust-checkpoint", str(run)]):
        code = cli_main(["train", "debug=fast", f"trainer.output_dir={tmp_path / 'mine'}",
                         f"trainer.resume_from={run}", *trusted])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and err.count("error: ") == 1, (code, err)
        assert str(tag) in err and "complete.json: unreadable" in err and "nested too deeply" in err, err


def test_score_refuses_an_export_marker_nested_too_deeply(model_dir, tmp_path, capsys):
    # Was: commands/score.end_of_turn read dsrecipes_export.json with json.loads: a shared reward model directory
    # whose marker is 100000 '[' ended `dsrecipes score` in json's RecursionError traceback, exit 1.
    import json
    import shutil

    from tests.test_messages_hostile import refused

    model = tmp_path / "reward"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    config.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (model / "dsrecipes_export.json").write_text(DEEP, encoding="utf-8")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": [{"role": "user", "content": "a"}],
                                 "chosen": [{"role": "assistant", "content": "b"}],
                                 "rejected": [{"role": "assistant", "content": "c"}]}) + "\n", encoding="utf-8")
    refused(capsys, ["score", "--pairs", str(pairs), str(model)], f"{model / 'dsrecipes_export.json'}: unreadable",
            "nested too deeply")
    assert not (tmp_path / "pairs.rewards.jsonl").exists()


MAIL = "--mail-user=jobs@attacker.example"


def test_a_shared_recipe_cannot_have_slurm_mail_the_jobs_events_to_its_address(tmp_path, monkeypatch, capsys):
    # Was: launcher.slurm_sbatch_args is allow-listed element by element, so a shared recipe's '--mail-user=ADDR'
    # (with --mail-type=ALL) went into the batch script: Slurm mailed the user's job events to the recipe's author.
    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f'launcher:\n  slurm_sbatch_args: ["--mail-type=ALL", "{MAIL}"]\n', encoding="utf-8")
    refused(capsys, ["validate", "launcher=slurm", f"recipe={recipe}"],
            f"launcher.slurm_sbatch_args[1]: --mail-user set by {recipe}:2, a shared recipe")
    assert cli_main(["validate", "launcher=slurm", f"launcher.slurm_sbatch_args=['--mail-type=ALL','{MAIL}']"]) == 0
    recipe.write_text('launcher:\n  slurm_sbatch_args: ["--qos=high"]\n', encoding="utf-8")
    assert cli_main(["validate", "launcher=slurm", f"recipe={recipe}"]) == 0


def test_a_pipeline_file_cannot_have_slurm_mail_the_jobs_events_to_its_address(tmp_path, capsys, monkeypatch):
    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)  # on a regression the pipeline runs: into runs/ here, never the checkout's
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f'stages:\n  - name: a\n    set:\n      launcher: {{slurm_sbatch_args: ["{MAIL}"]}}\n',
                        encoding="utf-8")
    refused(capsys, ["pipeline", str(pipeline)], f"{pipeline}:4: stages[0].set.launcher.slurm_sbatch_args: --mail-user")


def test_a_shared_prompts_file_nested_too_deeply_is_one_message(model_dir, tmp_path, capsys):
    # Was: serve/prompt_eval read each --prompts line with json.loads catching JSONDecodeError only: a line of
    # 100000 '[' ended prompt-eval in json's RecursionError traceback, exit 1.
    from tests.test_messages_hostile import refused

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n' + DEEP + "\n", encoding="utf-8")
    refused(capsys, ["prompt-eval", "--finetuned", str(model_dir), "--prompts", str(prompts)],
            f"{prompts}:2: JSON nested too deeply")


@pytest.mark.parametrize("args", [["--local_addr=attacker.example"], ["--local-addr", "attacker.example"]])
def test_a_shared_recipe_or_pipeline_cannot_name_torchruns_local_address(args, tmp_path, monkeypatch, capsys):
    # Was: launcher.extra_args allowed torchrun's --local_addr (a HOST) from any recipe: when this node hosts the
    # rendezvous, every rank connects to that address, the very thing launcher.master_addr keeps user-named.
    import json

    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f"launcher:\n  extra_args: {json.dumps(args)}\n", encoding="utf-8")
    refused(capsys, ["validate", "launcher=torchrun", f"recipe={recipe}"],
            f"launcher.extra_args[0]: {args[0].partition('=')[0]} set by {recipe}:2, a shared recipe")
    assert cli_main(["validate", "launcher=torchrun", "launcher.extra_args=['--local_addr=10.0.0.1']"]) == 0
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"stages:\n  - name: a\n    set:\n      launcher.extra_args: {json.dumps(args)}\n",
                        encoding="utf-8")
    refused(capsys, ["pipeline", str(pipeline)], f"{pipeline}:4: stages[0].set.launcher.extra_args: {args[0].partition('=')[0]}",
            "run this stage with `dsrecipes train` and give launcher.extra_args=[...] on its command line")
