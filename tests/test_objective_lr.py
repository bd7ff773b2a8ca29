"""The default learning rate per objective: with optimizer.lr unset, a pretrained model trains at its model group's
finetune_lr (model.lora.finetune_lr under LoRA) x objective.lr_scale (1 for sft and reward, 0.1 for dpo, orpo and
grpo); the embedded tiny model (random init) at model.tiny.finetune_lr for every objective; an explicit optimizer.lr
as set. The launch says which (lr_note), `dsrecipes show` names the scale, a bad scale is one exit-2 message, and a
run's config.yaml holds the concrete rate, which the ranks and a resume read without scaling it again."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dsrecipes.config.defaults import learning_rate, lr_note, lr_source, with_derived_defaults
from dsrecipes.config.load import compose_and_load
from tests.conftest import in_process_environ, subprocess_env

SMOLLM2 = "model=smollm2_135m"  # finetune_lr 5e-5, lora.finetune_lr 3e-4 (conf/model/smollm2_135m.yaml)
SCALES = {"sft": 1.0, "reward": 1.0, "dpo": 0.1, "orpo": 0.1, "grpo": 0.1}


def cfg(*overrides: str):
    return compose_and_load(list(overrides), check_files=False)


def dsr(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsrecipes", *args], capture_output=True, text=True, cwd=cwd,
                          env=subprocess_env(), timeout=300)


@pytest.mark.parametrize("objective,scale", sorted(SCALES.items()))
def test_each_objective_scales_the_models_rate(objective, scale):
    full = cfg(SMOLLM2, f"objective={objective}")
    assert full.objective.lr_scale == scale and full.optimizer.lr is None
    assert learning_rate(full) == pytest.approx(5e-5 * scale, rel=1e-12)
    lora = cfg(SMOLLM2, f"objective={objective}", "model.lora.enabled=true")
    assert learning_rate(lora) == pytest.approx(3e-4 * scale, rel=1e-12)
    scaled = " x objective.lr_scale" if scale != 1.0 else ""
    assert lr_source(full) == "model.finetune_lr" + scaled
    assert lr_source(lora) == "model.lora.finetune_lr" + scaled
    # what config.yaml holds: the concrete rate, printed as written (5e-06, not 5.000000000000001e-06)
    assert with_derived_defaults(full).optimizer.lr == float(f"{5e-5 * scale:g}")


def test_dpo_on_smollm2_trains_at_a_tenth_and_says_so():
    dpo = cfg(SMOLLM2, "objective=dpo")
    assert learning_rate(dpo) == 5e-6
    assert lr_note(dpo) == ("learning rate: 5e-06 from model.finetune_lr x objective.lr_scale (SmolLM2-135M-Instruct's "
                            "full fine-tuning rate 5e-05 x 0.1 for dpo; optimizer.lr is unset); optimizer.lr=VALUE "
                            "sets another")
    lora = cfg(SMOLLM2, "objective=grpo", "model.lora.enabled=true")
    assert lr_note(lora) == ("learning rate: 3e-05 from model.lora.finetune_lr x objective.lr_scale "
                             "(SmolLM2-135M-Instruct's LoRA rate 0.0003 x 0.1 for grpo; optimizer.lr is unset); "
                             "optimizer.lr=VALUE sets another")
    sft = cfg(SMOLLM2)
    assert lr_note(sft) == ("learning rate: 5e-05 from model.finetune_lr (SmolLM2-135M-Instruct's full fine-tuning "
                            "rate; optimizer.lr is unset); optimizer.lr=VALUE sets another")


def test_a_users_own_scale_and_a_path_on_the_default_group():
    assert learning_rate(cfg(SMOLLM2, "objective=dpo", "objective.lr_scale=0.5")) == 2.5e-5
    assert learning_rate(cfg(SMOLLM2, "objective=sft", "objective.lr_scale=0.5")) == 2.5e-5
    # model.path on the default group: the schema's finetune_lr 2e-5
    assert learning_rate(cfg("model.path=/models/sft_export", "objective=orpo")) == 2e-6


@pytest.mark.parametrize("objective", sorted(SCALES))
def test_an_explicit_optimizer_lr_is_used_as_set(objective):
    for extra in ([], ["model.lora.enabled=true"]):
        c = cfg(SMOLLM2, f"objective={objective}", "optimizer.lr=1e-4", *extra)
        assert learning_rate(c) == 1e-4 and lr_source(c) == "optimizer.lr" and lr_note(c) is None
        assert with_derived_defaults(c).optimizer.lr == 1e-4


@pytest.mark.parametrize("objective", sorted(SCALES))
def test_the_embedded_tiny_model_keeps_its_rate_for_every_objective(objective):
    tiny = cfg(f"objective={objective}")
    assert tiny.model.path is None and learning_rate(tiny) == 3e-3
    assert lr_source(tiny) == "model.tiny.finetune_lr"
    note = lr_note(tiny)
    assert note.startswith("learning rate: 0.003 from model.tiny.finetune_lr (the embedded tiny model's rate"), note
    if SCALES[objective] != 1.0:
        assert "random init: objective.lr_scale 0.1 is not applied" in note, note


def test_the_rank_reads_the_stored_rate_and_never_scales_it_again(tmp_path):
    """config.yaml holds optimizer.lr=5e-06 and objective.lr_scale=0.1: what a rank reads from it (load_run_config's
    load_config, here without its file checks: SmolLM2 need not be fetched), the DeepSpeed JSON and the schedule's
    peak (learning_rate) is 5e-06, not 5e-07."""
    from dsrecipes.config.load import load_config
    from dsrecipes.core.rundir import write_config
    from dsrecipes.core.typed import config_to_dict
    from dsrecipes.run.ds_config import build_ds_config

    write_config(tmp_path, config_to_dict(with_derived_defaults(cfg(SMOLLM2, "objective=dpo"))))
    stored = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert stored["optimizer"]["lr"] == 5e-6 and stored["objective"]["lr_scale"] == 0.1
    rank = load_config(stored, check_files=False)
    assert learning_rate(rank) == 5e-6 and lr_note(rank) is None
    assert build_ds_config(rank, 1)["optimizer"]["params"]["lr"] == 5e-6


@pytest.mark.parametrize("value", ["0", "-1", "2", "1.5", "abc"])
def test_a_bad_lr_scale_is_one_message_naming_the_key(tmp_path, value):
    out = dsr("validate", SMOLLM2, "objective=dpo", f"objective.lr_scale={value}", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("error: objective.lr_scale: ") and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1, out.stderr  # one message
    if value != "abc":
        assert "must be in (0, 1]" in out.stderr and f"got {float(value)}" in out.stderr, out.stderr


def test_show_names_the_scale(tmp_path):
    out = dsr("show", SMOLLM2, "objective=dpo", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("  lr: ")]
    assert lines == ["  lr: 5.0e-06  # model.finetune_lr x objective.lr_scale (5e-05 x 0.1 for dpo; "
                     "optimizer.lr unset)"], lines
    out = dsr("show", "objective=dpo", cwd=tmp_path)  # the embedded tiny model
    lines = [line for line in out.stdout.splitlines() if line.startswith("  lr: ")]
    assert lines == ["  lr: 0.003  # model.tiny.finetune_lr (objective.lr_scale 0.1 not applied to the tiny model; "
                     "optimizer.lr unset)"], lines


def _launch(ws: Path, *overrides: str):
    from dsrecipes.cli import main

    out = io.StringIO()
    with in_process_environ(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["objective=dpo", "dataset=sample_pairs", "dataset.max_samples=24", "dataset.val_size=0",
                     "data.cutoff_len=128", "trainer.micro_batch_size=4", "trainer.log_every=1",
                     "scheduler=constant", "scheduler.warmup_steps=0", "trainer.save_every=2",
                     "trainer.export=false", "trainer.report_to=[]", f"data.cache_dir={ws / 'cache'}",
                     f"trainer.output_dir={ws / 'run'}", f"hydra.run.dir={ws / 'run'}", *overrides])
    return code, out.getvalue()


@pytest.mark.slow
def test_a_resumed_dpo_run_keeps_the_rate_it_started_with(tmp_path, model_dir):
    """A DPO run of a pretrained model (the tiny model saved as a Hugging Face directory: model.finetune_lr 2e-5,
    the schema's) trains at 2e-06; the same command resumed trains on at 2e-06 (config.yaml, the DeepSpeed JSON and
    the logged rate), and a resume with another objective.lr_scale is refused (the objective must match)."""
    model = f"model.path={model_dir}"
    code, said = _launch(tmp_path, model, "trainer.max_steps=2")
    assert code == 0, said[-3000:]
    assert "learning rate: 2e-06 from model.finetune_lr x objective.lr_scale" in said, said
    run = tmp_path / "run"

    def stored():
        config = yaml.safe_load((run / "config.yaml").read_text())
        return config["optimizer"]["lr"], json.loads((run / "ds_config.json").read_text())["optimizer"]["params"]["lr"]

    assert stored() == (2e-6, 2e-6)
    code, said = _launch(tmp_path, model, "trainer.max_steps=4")
    assert code == 0, said[-3000:]
    assert "resuming" in said and "optimizer.lr" not in said.split("resuming", 1)[1].split("\n", 1)[0], said
    assert stored() == (2e-6, 2e-6)
    rates = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "lr" in r}
    assert set(rates) == {1, 2, 3, 4} and all(v == pytest.approx(2e-6) for v in rates.values()), rates
    code, said = _launch(tmp_path, model, "trainer.max_steps=6", "objective.lr_scale=0.5")
    assert code == 2 and "objective.lr_scale: 0.1 -> 0.5" in said, said[-3000:]


@pytest.mark.parametrize("objective", sorted(SCALES))
def test_an_lr_scale_an_explicit_optimizer_lr_makes_unused_is_a_warning(objective):
    """`objective.lr_scale=0.5` with `optimizer.lr` set has no effect: the launch (and `validate`) say so, naming both
    keys; the objective's own scale (its group's) with an explicit rate is not worth a line."""
    from dsrecipes.config.defaults import config_warnings

    said = [w for w in config_warnings(cfg(SMOLLM2, f"objective={objective}", "optimizer.lr=1e-6",
                                           "objective.lr_scale=0.5")) if w.startswith("objective.lr_scale")]
    assert said == ["objective.lr_scale: 0.5 is unused: optimizer.lr=1e-06 sets the rate as it is (lr_scale "
                    "multiplies the model's finetune_lr only when optimizer.lr is unset)"]
    for quiet in (cfg(SMOLLM2, f"objective={objective}", "optimizer.lr=1e-6"),
                  cfg(SMOLLM2, f"objective={objective}", "objective.lr_scale=0.5")):
        assert not [w for w in config_warnings(quiet) if "lr_scale" in w]
