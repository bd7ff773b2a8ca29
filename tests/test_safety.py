"""No code from configuration: recipes, group files and overrides that try every route to running code are refused
(exit 2, one message naming the file or override) by a run, a sweep, `--cfg`/`--help`, `validate` and
`validate --all`, and the marker files they target are never created or changed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.cli import main as cli_main
from tests.conftest import REPO, subprocess_env

KEPT_OPTIONS = {"data": {"map"}, "dataset": {"sample"}, "model": {"tiny"}, "template": {"auto"},
                "zero": {"stage0"}, "offload": {"none"}, "precision": {"fp32"}, "optimizer": {"adamw"},
                "scheduler": {"cosine"}, "trainer": {"default"}, "launcher": {"local", "torchrun"},
                "objective": {"sft"}}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A copy of the project's conf/ (default options only, so validate --all stays quick) with hostile files, as
    DSRECIPES_HOME. Returns (root, markers dir, precious file, {route: (args, file or override named)})."""
    root = tmp_path / "proj"
    shutil.copytree(REPO / "conf", root / "conf", symlinks=True)
    (root / "recipes").mkdir()
    for group in (root / "conf").iterdir():
        if group.is_dir() and not group.is_symlink():
            for option in group.glob("*.yaml"):
                if option.stem not in KEPT_OPTIONS.get(group.name, ()):
                    option.unlink()
    m = tmp_path / "markers"
    m.mkdir()
    precious = m / "precious.txt"
    precious.write_text("precious\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"open({str(m / 'from_pythonpath')!r}, 'w').write('ran')\n")
    files = {
        "recipes/clean.yaml": "# @package _global_\ntrainer: {max_steps: 1}\nscheduler: {warmup_steps: 0}\n",
        "recipes/callback.yaml": f"""# @package _global_
hydra:
  callbacks:
    touch: {{_target_: builtins.open, file: {m / 'callback'}, mode: w}}
""",
        "recipes/chain.yaml": f"""# @package _global_
hydra:
  callbacks:
    first: {{_target_: shutil.copyfile, src: {precious}, dst: {m / 'copied'}}}
    second: {{_target_: builtins.open, file: {precious}, mode: w}}
""",
        "recipes/target.yaml": f"""# @package _global_
model:
  arch: {{_target_: builtins.open, file: {m / 'target'}, mode: w}}
""",
        "recipes/env.yaml": f"""# @package _global_
launcher:
  env: {{PYTHONPATH: {site}, LD_PRELOAD: {m / 'evil.so'}}}
""",
        "recipes/env_set.yaml": f"""# @package _global_
hydra:
  job:
    env_set: {{PYTHONPATH: {site}}}
""",
        "recipes/secret.yaml": "# @package _global_\ntrainer: {experiment: 'sft-${oc.env:DSR_TEST_SECRET}'}\n",
        "recipes/resolver.yaml": "# @package _global_\ntrainer: {experiment: '${oc.decode:x}'}\n",
        "recipes/overrides.yaml": "# @package _global_\nhydra: {overrides: {task: ['--trust-checkpoint=/x']}}\n",
        "conf/dataset/logging.yaml": f"""# @package _global_
defaults:
  - /schema/dataset@dataset
  - _self_
hydra:
  job_logging:
    version: 1
    root: {{handlers: [factory, file], level: INFO}}
    handlers:
      factory: {{"()": builtins.open, file: {m / 'factory'}, mode: w}}
      file: {{class: logging.FileHandler, filename: {precious}, mode: w}}
""",
        "conf/trainer/into_callbacks.yaml": f"""# @package hydra.callbacks
touch: {{_target_: builtins.open, file: {m / 'package'}, mode: w}}
""",
    }
    for user in ("user/file_evil", "user_folder/folder_evil"):  # user recipes: a file by path, a folder's recipe
        files[f"../{user}.yaml"] = files["recipes/callback.yaml"].replace("markers/callback", f"markers/{user[:4]}")
    (tmp_path / "user").mkdir()
    (tmp_path / "user_folder").mkdir()
    for rel, text in files.items():
        (root / rel).write_text(text)
    monkeypatch.setenv("DSRECIPES_HOME", str(root))
    monkeypatch.setenv("DSRECIPES_RECIPES", str(tmp_path / "user_folder"))
    monkeypatch.chdir(tmp_path)
    return root, m, precious


def untouched(markers: Path, precious: Path) -> None:
    assert sorted(p.name for p in markers.iterdir()) == ["precious.txt"], "a configuration ran code"
    assert precious.read_text() == "precious\n"


ROUTES = {  # route -> (arguments, what the message must name)
    "recipe callback": (["recipe=callback"], "proj/recipes/callback.yaml"),
    "user recipe file": (["recipe=./user/file_evil.yaml"], "/user/file_evil.yaml"),
    "user recipe folder": (["recipe=folder_evil"], "/user_folder/folder_evil.yaml"),
    "chain of two callbacks": (["recipe=chain"], "proj/recipes/chain.yaml"),
    "_target_ outside hydra": (["recipe=target"], "model.arch._target_: names code to run ('builtins.open'), set by "),
    "group file logging factory": (["dataset=logging"], "proj/conf/dataset/logging.yaml"),
    "group file packaged into hydra.callbacks": (["trainer=into_callbacks"], "proj/conf/trainer/into_callbacks.yaml"),
    "recipe hydra.job.env_set": (["recipe=env_set"], "hydra.job.env_set"),
    "recipe launcher.env": (["recipe=env"], "launcher.env.LD_PRELOAD: not an allowed variable"),
    "override callback": (["+hydra.callbacks.x._target_=builtins.open", "+hydra.callbacks.x.file=x"],
                          "command-line override '+hydra.callbacks.x._target_=builtins.open'"),
    "override logging group": (["hydra/job_logging=default"], "command-line override 'hydra/job_logging=default'"),
    "override search path": (["hydra.searchpath=[file:///tmp]"], "command-line override 'hydra.searchpath"),
    "override _target_": (["+model.arch._target_=builtins.open"],
                          "set by command-line override '+model.arch._target_=builtins.open'"),
    "override launcher.env": (["+launcher.env.PYTHONPATH=/tmp"], "launcher.env.PYTHONPATH: not an allowed variable"),
    "recipe reads a secret": (["recipe=secret"], "trainer.experiment: reads the environment variable "
                              "'DSR_TEST_SECRET' (configuration may read only DSRECIPES_SMOLLM2_DIR; "),
    "recipe calls a resolver": (["recipe=resolver"], "trainer.experiment: calls the resolver 'oc.decode'"),
    "recipe sets hydra.overrides": (["recipe=overrides"], "hydra.overrides: changes the overrides Hydra records"),
    "override reads a secret": (["trainer.experiment=${oc.env:DSR_TEST_SECRET}"],  # refused where it resolves
                                "trainer.experiment: reads the environment variable 'DSR_TEST_SECRET'"),
}


@pytest.mark.parametrize("command", ["run", "validate"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_route_is_refused_and_runs_nothing(project, capsys, monkeypatch, route, command):
    _, markers, precious = project
    monkeypatch.setenv("DSR_TEST_SECRET", "s3cr3t-value")
    args, named = ROUTES[route]
    argv = (["trainer.max_steps=1", "scheduler.warmup_steps=0"] + args) if command == "run" else ["validate", *args]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and "Traceback" not in err, err
    assert "s3cr3t-value" not in err and "override_dirname" not in err  # (not Hydra's copies of an override)
    assert "hydra.overrides" not in err or "hydra.overrides" in named
    untouched(markers, precious)
    assert not (Path.cwd() / "outputs").exists() or not any((Path.cwd() / "outputs").rglob("config.yaml"))


def test_sweeps_check_every_job_before_the_first(project, capsys):
    _, markers, precious = project
    assert cli_main(["-m", "recipe=clean,callback", "launcher.dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "recipes/callback.yaml" in err
    untouched(markers, precious)
    assert not (Path.cwd() / "multirun").exists(), "nothing of the sweep is written before the refusal"


@pytest.mark.parametrize("flags", [["--cfg", "job"], ["--hydra-help"], ["--info", "config"]])
def test_informational_flags_do_not_configure_logging_from_a_recipe(project, capsys, flags):
    _, markers, precious = project
    assert cli_main([*flags, "dataset=logging"]) == 2
    assert "proj/conf/dataset/logging.yaml" in capsys.readouterr().err
    untouched(markers, precious)


@pytest.mark.parametrize("flag", ["--config-dir=/tmp", "--config-name=other", "--experimental-rerun=x.pickle"])
def test_flags_that_bring_other_configs_are_refused(project, capsys, flag):
    assert cli_main([flag]) == 2
    assert "not supported" in capsys.readouterr().err


def test_validate_all_names_every_hostile_file(project):
    root, markers, precious = project
    for name in ("chain", "target", "env_set", "clean", "secret", "resolver", "overrides"):  # checked above: fewer
        (root / "recipes" / f"{name}.yaml").unlink()
    env = subprocess_env({"DSRECIPES_HOME": str(root)})
    env.pop("DSRECIPES_RECIPES")  # (its recipe would add another round of compositions)
    out = subprocess.run([sys.executable, "-m", "dsrecipes", "validate", "--all"], capture_output=True, text=True,
                         cwd=root.parent, env=env, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    for name in ("recipes/callback.yaml", "conf/dataset/logging.yaml", "conf/trainer/into_callbacks.yaml",
                 "recipe=env: launcher.env.PYTHONPATH: not an allowed variable"):
        assert name in out.stderr, name
    untouched(markers, precious)


def test_the_project_itself_holds_only_its_sweep_callback():
    """conf/train.yaml's sweep callback still works: a plain composition passes, and sweeps get their summary."""
    from dsrecipes.config.load import compose

    assert "hydra" not in compose(["recipe=cpu_zero2_two_ranks"])


def test_a_run_with_launcher_env_never_starts_a_rank(project, tmp_path):
    """launcher.env PYTHONPATH would run sitecustomize.py in every rank; the run stops at validation (exit 2)."""
    root, markers, precious = project
    out = subprocess.run([sys.executable, "-m", "dsrecipes", "recipe=env", "launcher=torchrun", "trainer.max_steps=1",
                          "scheduler.warmup_steps=0", f"trainer.output_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, cwd=tmp_path,
                         env=subprocess_env({"DSRECIPES_HOME": str(root)}), timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "launcher.env.PYTHONPATH: not an allowed variable" in out.stderr
    untouched(markers, precious)
    assert not (tmp_path / "run" / "launch.txt").exists()


def test_models_that_need_their_own_code_are_refused(tmp_path, capsys, monkeypatch):
    """A model directory whose config names custom code: one message, exit 2, and its code never runs."""
    import json

    monkeypatch.chdir(tmp_path)
    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    model = tmp_path / "custom"
    shutil.copytree(TINY_TOKENIZER_DIR, model)
    (model / "config.json").write_text(json.dumps({"model_type": "not_in_transformers", "auto_map": {
        "AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"}}))
    marker = tmp_path / "ran"
    (model / "configuration_x.py").write_text(f"open({str(marker)!r}, 'w')\n")
    (model / "modeling_x.py").write_text(f"open({str(marker)!r}, 'w')\n")
    rc = cli_main([f"model.path={model}", "launcher.dry_run=true", f"trainer.output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"model.path: {model} needs its own Python code to load" in err and "Traceback" not in err
    assert cli_main(["validate", "model.trust_remote_code=true"]) == 2
    assert "model.trust_remote_code: must stay false" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "run" / "launch.txt").exists()


def test_launcher_env_allow_list():
    """A positive table (boundary/rank_env.py): documented tuning names only, each value of its type."""
    from dsrecipes.config.validate import launcher_env_problems

    allowed = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "CUDA_VISIBLE_DEVICES": "0,1",
               "OMP_NUM_THREADS": "4", "GLOO_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
               "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TOKENIZERS_PARALLELISM": "false",
               "DS_ACCELERATOR": "cpu", "NCCL_IB_DISABLE": "1"}
    refused = ["PYTHONPATH", "PYTHONSTARTUP", "LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "DS_ENV_FILE",
               "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "CUDA_INJECTION64_PATH", "TORCH_EXTENSIONS_DIR",
               "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_MODULES_CACHE", "FI_PROVIDER_PATH", "BASH_ENV",
               "NCCL_CONF_FILE", "DSRECIPES_HOME", "DSRECIPES_RECIPES", "nccl_debug", "X;rm -rf ~", "CUDA_HOME",
               "TORCH_NVCC_FLAGS", "OMP_TOOL_LIBRARIES", "UCX_MODULE_DIR", "HF_HOME", "TORCH_LOGS_OUT",
               "NCCL_DEBUG_FILE", "TORCH_TRACE", "DSRECIPES_STALL_AFTER_STEP"]
    assert [n for n, v in allowed.items() if launcher_env_problems({n: v})] == []
    assert [n for n in refused if not launcher_env_problems({n: "1"})] == []
    assert launcher_env_problems({"NCCL_DEBUG": "INFO\nLD_PRELOAD=/x.so"})  # a second line in .deepspeed_env
