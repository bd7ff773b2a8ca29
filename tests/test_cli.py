"""The command line through real subprocesses, from a foreign working directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import subprocess_env


def dsr(*args, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", "dsrecipes", *args], capture_output=True, text=True, cwd=cwd,
                          env=subprocess_env(), timeout=timeout)


@pytest.mark.slow
def test_validate_all_from_a_foreign_directory(tmp_path):
    out = dsr("validate", "--all", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("validated ") and " 0 failures" in first
    assert int(first.split()[1]) > 100


def test_validate_never_imports_torch(tmp_path):
    code = ("import sys; from dsrecipes.cli import main; rc = main(['validate', 'zero=stage3', 'precision=fp16']); "
            "assert 'torch' not in sys.modules, 'validate imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK: data=map")


def test_cfg_job_prints_the_composition(tmp_path):
    out = dsr("--cfg", "job", "zero=stage2", "data=iterable", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "stage: 2" in out.stdout and "kind: iterable" in out.stdout
    assert not (tmp_path / "outputs").exists()


def test_show_prints_config_and_deepspeed_json(tmp_path):
    out = dsr("show", "zero=stage3", "--world-size", "8", "--json-only", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    ds = json.loads(out.stdout)
    assert ds["train_batch_size"] == 8 * 8 and ds["zero_optimization"]["stage"] == 3
    out = dsr("show", cwd=tmp_path)
    assert "# resolved config" in out.stdout and "micro_batch_size: 8" in out.stdout


def test_ls_lists_groups_options_and_recipes(tmp_path):
    out = dsr("ls", cwd=tmp_path)
    assert out.returncode == 0
    for word in ("zero (zero=OPTION):", "stage3", "offload (", "cpu_optimizer_params", "recipes", "sharegpt_lora_llama3_8b_zero3"):
        assert word in out.stdout


@pytest.mark.parametrize("args,needle", [
    (["trainer.max_step=5"], "trainer.max_step: unknown key; did you mean trainer.max_steps?"),
    (["+trainer.typo=1"], "trainer.typo: unknown key"),
    (["zero=stage2", "offload=cpu_optimizer_params"], "offload.param: parameter offload (cpu) needs ZeRO-3"),
    (["validate", "data.kind=mapp"], "data.kind: invalid value 'mapp' (expected one of map, iterable, presharded); "
                                     "did you mean map?"),
    (["show", "zero=stage9"], "zero=stage9: no option 'stage9' in group 'zero'"),
    (["doctr"], "unknown command 'doctr'; did you mean doctor?"),
    (["-m", "zero=stag2,stage3", "launcher.dry_run=true"], "zero=stag2: no option 'stag2' in group 'zero'; "
                                                          "did you mean stage2?"),
])
def test_mistakes_exit_2_with_one_message_and_no_traceback(tmp_path, args, needle):
    out = dsr(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert needle in out.stderr and "Traceback" not in out.stderr and out.stderr.startswith("error: ")
    assert not (tmp_path / "outputs").exists()


def test_console_script_matches_module(tmp_path):
    exe = Path(sys.executable).parent / "dsrecipes"
    if not exe.exists():
        pytest.skip("console script not installed next to this interpreter")
    a = subprocess.run([str(exe), "validate"], capture_output=True, text=True, cwd=tmp_path, env=subprocess_env())
    b = dsr("validate", cwd=tmp_path)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout


@pytest.mark.parametrize("argv,message", [
    (["validate", "trainer.lr=1"], "trainer.lr: unknown key; did you mean optimizer.lr?"),
    (["validate", "trainr.max_steps=3"], "trainr.max_steps: unknown key; did you mean trainer.max_steps?"),
    (["validate", "zeros=stage2"], "zeros: unknown key; did you mean zero?"),
    (["validate", "recipe=cpu_zero2_tworanks"], "did you mean cpu_zero2_two_ranks?"),
    (["validate", "debug=fastt"], "debug=fastt: no option 'fastt' in group 'debug'; did you mean fast?"),
    (["validate", "--alll"], "dsrecipes validate: unrecognized arguments: --alll; did you mean --all?"),
    (["show", "--world-sze", "2"], "unrecognized arguments: --world-sze; did you mean --world-size?"),
    (["valdate"], "unknown command 'valdate'; did you mean validate?"),
    (["ls", "zer"], "no config group 'zer'; did you mean zero?"),
    (["--cfg", "job", "trainer.max_step=1"], "trainer.max_step: unknown key; did you mean trainer.max_steps?"),
    (["zero=stage2", "recipe"], "'recipe' is not a command, KEY=VALUE, GROUP=OPTION or a flag; "
                                "did you mean recipe=...?"),
    (["frobnicate"], "'frobnicate' is not a command, KEY=VALUE, GROUP=OPTION or a flag (see dsrecipes --help)"),
    (["launcher.env.FOO=1"], "launcher.env is a mapping: add a key to it with +launcher.env.FOO=VALUE"),
    (["merge", "runs/x"], "unknown command 'merge'; for that here: dsrecipes export RUN --out DIR"),
    (["webchat"], "unknown command 'webchat'; for that here: dsrecipes chat RUN"),  # llamafactory-cli's commands
    (["eval"], "for that here: dsrecipes prompt-eval --baseline RUN --finetuned RUN"),
    (["train", "smollm2_cpu_sft"], "'smollm2_cpu_sft' is not a command, KEY=VALUE, GROUP=OPTION or a flag; "
                                   "did you mean recipe=smollm2_cpu_sft?"),
    (["train", "my_exp"], "did you mean my_exp.yaml (dsrecipes train my_exp.yaml)?"),  # the file is here
])
def test_did_you_mean_in_one_exit_2_message(argv, message, capsys, tmp_path, monkeypatch):
    from dsrecipes.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_exp.yaml").write_text("trainer.max_steps: 3\n")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and err.count("error:") == 1, err
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("body,message", [
    ("# @package _global_\ntrainer:\n  max_step: 30\n", "{file}:3: trainer.max_step: unknown key; "
                                                            "did you mean trainer.max_steps?"),
    ("# @package _global_\ndefaults:\n  - override /zero: stag2\n", "zero=stag2: no option 'stag2' in group 'zero'; "
                                                                        "did you mean stage2? (options: stage0, "
                                                                        "stage1, stage2, stage3) [in {file}:3]"),
    ("# @package _global_\ndefaults:\n  - override /zer: stage2\n", "{file}: no config group 'zer'; did you mean zero?"),
    ("# @package _global_\ntrainer:\n  max_steps: [1\n", "{file}:4: not valid YAML"),
    ("# @package _global_\ndata:\n  kind: mapp\n", "did you mean map?"),
])
def test_did_you_mean_inside_recipe_files(body, message, capsys, tmp_path):
    from dsrecipes.cli import main

    recipe = tmp_path / "mine.yaml"
    recipe.write_text(body)
    assert main(["validate", f"recipe={recipe}"]) == 2
    err = capsys.readouterr().err
    assert message.format(file=recipe) in err and err.count("error:") == 1, err


def test_version_names_dsrecipes_and_what_it_drives(capsys):
    from dsrecipes.cli import main

    for argv in (["--version"], ["train", "--version"]):
        assert main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("dsrecipes 0.") and "Hydra" not in out[0]
        assert [line.split()[0] for line in out[1:4]] == ["torch", "deepspeed", "transformers"]


def test_train_help_is_dsrecipes_own(capsys):
    from dsrecipes.cli import main

    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dsrecipes [train]") and "powered by Hydra" not in out
    assert "dsrecipes train FILE.yaml" in out.splitlines()[1]  # a recipe file of one's own, on the usage lines
    assert "schema" not in out.split("keys (")[0], "the internal schema group is listed"
    assert "  zero          *stage0 stage1 stage2 stage3" in out
    assert "  trainer.      micro_batch_size" in out and "report_to" in out and "recipe=/path/to/file.yaml" in out


def test_every_option_file_has_a_description_and_ls_prints_it_whole(capsys):
    from dsrecipes.cli import main
    from dsrecipes.config.groups import describe, group_options

    options = [(g, o) for g, opts in group_options().items() for o in opts]
    assert len(options) > 40
    missing = [f"{g}/{o}" for g, o in options if not describe(g, o)]
    assert not missing, f"option files without an opening comment: {missing}"
    assert main(["ls"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    for group, option in options:
        for line in describe(group, option):
            assert " ".join(line.split()) in out, (group, option, line)


def test_ls_help_and_group_filter(capsys):
    from dsrecipes.cli import main

    with pytest.raises(SystemExit) as done:
        main(["ls", "--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: dsrecipes ls")
    assert main(["ls", "zero"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("zero (zero=OPTION):") and "stage3" in out and "offload" not in out


def test_nvme_offload_without_async_io_is_one_message_before_anything_is_written(tmp_path):
    """Where DeepSpeed cannot build its async_io op (no libaio, as on the test machines), `offload=nvme` exits 2 with
    one message naming the key, before a run directory is claimed or an op is built; a foreign file in the output
    directory survives untouched."""
    from dsrecipes.core import jit_ops

    if jit_ops.async_io_buildable():
        pytest.skip("libaio is installed here: DeepSpeed can build async_io, nothing to refuse")
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    out = subprocess.run([sys.executable, "-m", "dsrecipes", "offload=nvme", "zero=stage3",
                          f"offload.nvme_path={tmp_path / 'nvme'}", f"trainer.output_dir={run}", f"hydra.run.dir={run}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=subprocess_env({"XDG_CACHE_HOME": str(tmp_path / "cache"), "TORCH_EXTENSIONS_DIR": None}))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "offload.optimizer: nvme offload needs DeepSpeed's async_io op" in out.stderr and "Traceback" not in out.stderr
    assert [p.name for p in run.iterdir()] == ["notes.txt"] and (run / "notes.txt").read_text() == "mine"
    assert not list((tmp_path / "cache").rglob("*.so"))  # no pin_memory (or any) op was built first
