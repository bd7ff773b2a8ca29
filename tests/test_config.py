"""Composition and load_config(): every option of every group, every recipe, and the negative cases."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsrecipes.config.groups import RECIPE_GROUP, group_options, recipes
from dsrecipes.config.load import check_composition, compose, compose_and_load, hydra_context
from dsrecipes.config.validate import check_runtime
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import DataKind, OffloadDevice, Precision, TrainConfig

REPO = Path(__file__).resolve().parents[1]
OPTIONS = [(g, o) for g, opts in group_options().items() if g != RECIPE_GROUP for o in opts]
RECIPES = recipes()


def test_groups_and_recipes_are_discovered():
    groups = group_options()
    for g in ("data", "dataset", "model", "template", "zero", "offload", "precision", "optimizer", "scheduler",
              "launcher", "trainer", "debug"):
        assert groups.get(g), f"group {g} has no options"
    assert set(groups["data"]) == {"map", "iterable", "presharded"}
    assert set(groups["zero"]) == {"stage0", "stage1", "stage2", "stage3"}
    assert {"none", "cpu_optimizer", "cpu_optimizer_params", "nvme"} <= set(groups["offload"])
    assert {"fp32", "bf16", "fp16"} <= set(groups["precision"])
    assert {"adamw", "adam", "lion", "sgd"} <= set(groups["optimizer"])
    assert {"cosine", "linear", "constant"} <= set(groups["scheduler"])
    assert {"local", "deepspeed", "deepspeed_multinode", "torchrun", "mpirun", "slurm"} <= set(groups["launcher"])
    assert len(OPTIONS) > 30 and len(RECIPES) >= 4


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_group_option_composes_against_the_schema(group, option):
    with hydra_context():
        composed = compose([f"{group}={option}"])
    cfg, schema_errors, rule_errors = check_composition(composed, check_files=False)
    assert not schema_errors
    if not rule_errors:
        assert isinstance(cfg, TrainConfig)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_validates(recipe):
    cfg = compose_and_load([f"recipe={recipe}"], check_files=False)
    assert isinstance(cfg, TrainConfig)
    text = (REPO / "recipes" / f"{recipe}.yaml").read_text()
    assert text.startswith("# @package _global_") and f"recipe={recipe}" in text, "recipes carry their command"


def test_default_config_is_the_cpu_quickstart():
    cfg = compose_and_load([])
    assert cfg.model.path is None and cfg.launcher.kind.value == "local" and cfg.data.kind is DataKind.map
    assert cfg.precision.dtype is Precision.fp32 and cfg.dataset.paths[0].endswith("sample_data/train.jsonl")


def test_groups_are_orthogonal():
    cfg = compose_and_load(["zero=stage3", "offload=cpu_optimizer_params", "precision=bf16"], check_files=False)
    assert cfg.zero.stage == 3 and cfg.offload.param is OffloadDevice.cpu and cfg.precision.dtype is Precision.bf16


def _problems(*overrides, check_files=False):
    with pytest.raises(ConfigError) as info:
        compose_and_load(list(overrides), check_files=check_files)
    return info.value.problems


def test_typo_on_the_command_line():
    (msg,) = _problems("trainer.micro_batchsize=2")
    assert msg == ("trainer.micro_batchsize: unknown key; did you mean trainer.micro_batch_size? "
                   "[from command-line override 'trainer.micro_batchsize=2']")


def test_plus_typo_is_not_silently_dropped():
    (msg,) = _problems("+trainer.typo=1")
    assert msg.startswith("trainer.typo: unknown key") and "[from command-line override '+trainer.typo=1']" in msg
    (msg,) = _problems("+foo=1")
    assert msg.startswith("foo: unknown key")


def test_bad_enum_and_wrong_type():
    (msg,) = _problems("data.kind=foo")
    assert msg == ("data.kind: invalid value 'foo' (expected one of map, iterable, presharded) "
                   "[from command-line override 'data.kind=foo']")
    (msg,) = _problems("trainer.micro_batch_size=abc")  # an int or "auto" (issue 46): checked by config/validate.py
    assert msg == "trainer.micro_batch_size: must be an integer >= 1 or 'auto' (the largest that fits), got 'abc'"


def test_unknown_group_option():
    (msg,) = _problems("zero=stage9")
    assert msg == ("zero=stage9: no option 'stage9' in group 'zero'; did you mean stage0, stage1 or stage2? "
                   "(options: stage0, stage1, stage2, stage3) [from command-line override 'zero=stage9']")


def test_typo_in_a_yaml_file_names_the_file(tmp_path, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(REPO / "conf", home / "conf", symlinks=True)
    shutil.copytree(REPO / "recipes", home / "recipes")
    (home / "conf" / "zero" / "typo.yaml").write_text("defaults:\n  - /schema/zero@_here_\n  - _self_\nstagee: 2\n")
    monkeypatch.setenv("DSRECIPES_HOME", str(home))
    (msg,) = _problems("zero=typo")
    assert "zero/typo" in msg and "stagee" in msg


def test_incompatible_stage_and_offload_and_all_problems_together():
    problems = _problems("zero=stage2", "offload=cpu_optimizer_params", "trainer.micro_batch_size=0")
    assert problems == [
        "offload.param: parameter offload (cpu) needs ZeRO-3, but zero.stage=2 (use zero=stage3, or offload=cpu_optimizer)",
        "trainer.micro_batch_size: must be >= 1, got 0",
    ]
    (msg,) = _problems("zero=stage0", "offload=cpu_optimizer")
    assert msg == "offload.optimizer: optimizer offload (cpu) needs ZeRO >= 1, but zero.stage=0"


def test_batch_size_is_derived_never_given():
    (msg,) = _problems("+trainer.train_batch_size=64")
    assert msg.startswith("trainer.train_batch_size: unknown key")
    (msg,) = _problems("trainer.grad_accum=0")
    assert msg == "trainer.grad_accum: must be >= 1, got 0"


def test_iterable_epochs_need_no_length_but_stream_keys_are_checked():
    """data=iterable counts its stream when the launching process indexes it, so trainer.epochs works alone."""
    assert compose_and_load(["data=iterable", "trainer.max_steps=null"], check_files=False)
    assert _problems("data=iterable", "data.block_bytes=0", "data.num_samples=0", "data.span_bytes=0") == [
        "data.block_bytes: must be >= 1 (or null: automatic), got 0",
        "data.span_bytes: must be >= 1, got 0",
        "data.num_samples: must be >= 1 (or null: the stream's count), got 0",
    ]
    assert _problems("data=iterable", "data.chunk_bytes=0") == [
        "data.chunk_bytes: must be >= 1 (or null: automatic), got 0"]
    for kind in ("map", "iterable", "presharded"):  # every strategy evaluates on validation files (issue 22)
        extra = ["data.shard_dir=/shards"] if kind == "presharded" else []
        assert compose_and_load([f"data={kind}", "dataset.val_paths=[/x.jsonl]", *extra], check_files=False)
    assert _problems("data=presharded") == [
        "data.shard_dir: data=presharded needs the directory written by `dsrecipes shard`"]


def test_files_must_exist():
    problems = _problems("dataset.paths=[/nonexistent/*.jsonl]", "model.path=/no/such/model", check_files=True)
    assert problems == [
        "dataset.paths[0]: '/nonexistent/*.jsonl' matches no file",
        "model.path: '/no/such/model' does not exist",
    ]


def test_a_directory_named_as_data_says_so(tmp_path):
    """A directory is not a data file (it may hold anything): validate and the stream both say to name its files."""
    from dsrecipes.data.sources.files import no_file

    (tmp_path / "a.jsonl").write_text("{}\n")
    (msg,) = _problems(f"dataset.paths=[{tmp_path}]", check_files=True)
    assert msg == f"dataset.paths[0]: '{tmp_path}' is a directory: name its files (e.g. '{tmp_path}/*.jsonl')"
    assert no_file(str(tmp_path / "*.json")) == f"'{tmp_path}/*.json' matches no file"


def test_fp16_is_valid_config_but_refused_without_cuda():
    cfg = compose_and_load(["precision=fp16"])
    assert cfg.precision.dtype is Precision.fp16
    (msg,) = check_runtime(cfg, cuda_available=False)
    assert msg.startswith("precision.dtype: fp16 needs a CUDA GPU")
    assert check_runtime(cfg, cuda_available=True) == []


def test_nvme_offload_is_refused_before_launch_where_deepspeed_cannot_build_async_io():
    """Without libaio a rank would JIT-build DeepSpeed's pin_memory op (minutes) and then fail on async_io: the
    launching side says so first, by DeepSpeed's own compatibility test (asked only for NVMe offload)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from dsrecipes.core import jit_ops

    cfg = compose_and_load(["offload=nvme", "zero=stage3", "offload.nvme_path=/tmp"])
    (msg,) = check_runtime(cfg, cuda_available=False, async_io=False)
    assert msg.startswith("offload.optimizer: nvme offload needs DeepSpeed's async_io op") and "libaio" in msg
    assert check_runtime(cfg, cuda_available=False, async_io=True) == []
    buildable = AsyncIOBuilder().is_compatible(verbose=False)
    assert jit_ops.async_io_buildable() is bool(buildable)
    assert (check_runtime(cfg, cuda_available=False) == []) is bool(buildable)  # asked of DeepSpeed here
    assert check_runtime(compose_and_load([]), cuda_available=False) == []  # no NVMe: DeepSpeed is not asked


def test_launcher_rules():
    problems = _problems("launcher=torchrun", "launcher.num_nodes=2", "launcher.include=localhost:0",
                         "launcher.master_port=70000")
    assert problems == [
        "launcher.include: --include/--exclude exist only for launcher=deepspeed, not torchrun",
        "launcher.rdzv_endpoint: torchrun on several nodes needs a rendezvous host:port "
        "(or launcher.master_addr set to node 0's address)",
        "launcher.master_port: must be in 1..65535, got 70000",
    ]
    (msg,) = _problems("launcher=deepspeed", "launcher.num_nodes=2")
    assert msg.startswith("launcher.hostfile: launcher=deepspeed on several nodes needs a hostfile")
    (msg,) = _problems("launcher=deepspeed", "launcher.num_gpus=2", "launcher.include=localhost:0")
    assert msg.startswith("launcher.include: deepspeed cannot combine --include/--exclude with --num_gpus")
    (msg,) = _problems("launcher=deepspeed", "launcher.peer_timeout_s=2")
    assert msg == "launcher.peer_timeout_s: 0 (off) or >= 5 seconds, got 2"
    (msg,) = _problems("launcher=slurm", "launcher.num_gpus=null")
    assert msg.startswith("launcher.num_gpus: launcher=slurm starts ranks on other machines")


def test_validate_all_layering_equals_real_composes():
    """`validate --all` layers recipe x option products from real composes (config/matrix.py); for the recipe that
    overrides the most groups, one other option of every group (and the global debug option) layered must equal
    Hydra's own composition. (All 270 layered products were compared once: identical.)"""
    import re

    from dsrecipes.config.matrix import as_container, layer, recipe_body

    def container(overrides):
        return as_container(compose(overrides))

    recipe = "sharegpt_lora_llama3_8b_zero3"
    text = (REPO / "recipes" / f"{recipe}.yaml").read_text(encoding="utf-8")
    chosen = dict(re.findall(r"override /(\w+): (\w+)", text))
    assert len(chosen) >= 5
    with hydra_context():
        base = container([f"{RECIPE_GROUP}={recipe}"])
        for group, opts in group_options().items():
            if group == RECIPE_GROUP:
                continue
            option = [o for o in opts if o != chosen.get(group)][-1]
            layered = layer(base, group, option, container([f"{group}={option}"]), recipe_body(recipe))
            assert layered == container([f"{RECIPE_GROUP}={recipe}", f"{group}={option}"]), (group, option)


@pytest.mark.parametrize("broken", ["optimizer/lion", pytest.param("template/llama3", marks=pytest.mark.slow)])
def test_validate_all_names_the_broken_option_file(tmp_path, broken):
    """A typo in one option file fails its row compose; validate --all then composes that row's options one by one,
    so the failure names the file and the key (and every other option still passes). template/llama3 is also used by
    a recipe: that recipe fails alone, yet composes with another template (llama3.yaml is then never loaded), so
    every product of the failed recipe is composed for real (one recipe: zero/stage2, used by three, took 67 s)."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    shutil.copytree(REPO / "conf", tmp_path / "conf", symlinks=True)
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    group, option = broken.split("/")
    path = tmp_path / "conf" / group / f"{option}.yaml"
    path.write_text(path.read_text(encoding="utf-8") + "typo_key: true\n", encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "dsrecipes", "validate", "--all"], capture_output=True, text=True,
                         env=subprocess_env({"DSRECIPES_HOME": str(tmp_path)}), timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    failures = [line for line in out.stderr.splitlines() if line.lstrip().startswith("- ")]
    assert failures and all(f"{group}.typo_key" in line for line in failures) and "Traceback" not in out.stderr
    assert any(line.lstrip().startswith(f"- {group}={option}:") for line in failures)  # the option itself, by name
    if group == "optimizer":
        recipes = len(list((REPO / "recipes").glob("*.yaml")))
        assert len(failures) == 1 + recipes  # lion on the defaults and on each recipe
    else:
        assert any(line.lstrip().startswith("- recipe=sharegpt_lora_llama3_8b_zero3:") for line in failures)
        assert not any("recipe=sharegpt_lora_llama3_8b_zero3 template=chatml" in line for line in failures)
