"""The Objective seam: every ObjectiveKind has a builder and an option file; the SFT objective reproduces the losses
the default run had before the seam existed (pinned below), and its evaluation returns sums."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest
import torch

from dsrecipes.core.paths import conf_dir
from dsrecipes.core.schema import ObjectiveKind
from dsrecipes.objectives import build_objective, builders
from tests.conftest import in_process_environ

# `python -m dsrecipes trainer.max_steps=6 trainer.log_every=1 trainer.eval_every=3` (the default composition: tiny
# model, sample data, map, fp32, one CPU process) on the code before objectives/ existed (commit cd3e6f8).
PINNED_LOSS = [7.698136806488037, 7.379759788513184, 7.283986568450928, 6.952406406402588, 6.712409973144531,
               6.640532493591309]
PINNED_GRAD_NORM = [4.188326835632324, 4.8222737312316895, 2.7092223167419434, 2.2477920055389404,
                    2.7628986835479736, 3.0028035640716553]
PINNED_EVAL = {3: 7.012213427611072, 6: 6.17560340725467}


def test_every_objective_kind_has_a_builder_and_an_option_file(make_cfg):
    assert set(builders()) == set(ObjectiveKind)
    options = {p.stem for p in (conf_dir() / "objective").glob("*.yaml")}
    assert options == {k.value for k in ObjectiveKind}
    for kind in ObjectiveKind:
        cfg = make_cfg(f"objective={kind.value}")
        assert cfg.objective.kind is kind
        from dsrecipes.core.tokenizer import load_tokenizer

        objective = build_objective(cfg, load_tokenizer(cfg))
        assert objective.kind is kind and objective.eval_keys


def test_objective_typo_fails_at_compose(make_cfg):
    from dsrecipes.core.errors import ConfigError

    with pytest.raises(ConfigError, match="objective"):
        make_cfg("objective=nope")
    with pytest.raises(ConfigError, match="objective.kindd"):
        make_cfg("objective.kindd=sft")


def test_sft_eval_sums_count_tokens_and_correct_predictions(make_cfg):
    """A model that always predicts the next label gets every counted token right; sums, not means."""
    from dsrecipes.core.tokenizer import load_tokenizer

    cfg = make_cfg()
    sft = build_objective(cfg, load_tokenizer(cfg))
    batch = sft.collate([{"ids": ["a"], "input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
                         {"ids": ["b"], "input_ids": [9, 10], "labels": [-100, 10]}])

    class Oracle(torch.nn.Module):
        def forward(self, input_ids, **_):
            logits = torch.full((*input_ids.shape, 16), -5.0)
            nxt = torch.nn.functional.pad(batch["input_ids"][:, 1:], (0, 1))
            logits.scatter_(2, nxt[..., None], 5.0)
            return type("Out", (), {"logits": logits})

    sums = sft.eval_sums(Oracle(), batch, torch.device("cpu"))
    assert sums["tokens"] == 3 and sums["correct"] == 3
    doubled = {k: 2 * v for k, v in sums.items()}  # two ranks' sums add up to the same means
    means = {k: v for k, v in sft.metrics(sums, "eval_").items() if k != "eval_tokens"}  # eval_tokens is a count
    assert {k: v for k, v in sft.metrics(doubled, "eval_").items() if k != "eval_tokens"} == pytest.approx(means)
    assert sft.metrics(doubled, "eval_")["eval_tokens"] == 2 * sft.metrics(sums, "eval_")["eval_tokens"]
    assert sft.metrics(sums, "eval_")["eval_accuracy"] == 1.0
    empty = sft.collate([])  # an empty micro-batch trains nothing and counts nothing
    assert empty["ids"] == [] and int((empty["labels"] != -100).sum()) == 0


ALLREDUCES: List[int] = []  # DeepSpeed gradient all-reduces during default_run (one rank, ZeRO-0: none)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from dsrecipes.cli import main

    run_dir = tmp_path_factory.mktemp("pinned") / "run"
    allreduce = DeepSpeedEngine.allreduce_gradients

    def counted(self, *args, **kwargs):
        ALLREDUCES.append(1)
        return allreduce(self, *args, **kwargs)

    DeepSpeedEngine.allreduce_gradients = counted
    try:
        with in_process_environ():
            code = main(["trainer.max_steps=6", "trainer.log_every=1", "trainer.eval_every=3", "trainer.export=false",
                         f"trainer.output_dir={run_dir}", f"hydra.run.dir={run_dir}",
                         f"data.cache_dir={run_dir.parent / 'cache'}"])
    finally:
        DeepSpeedEngine.allreduce_gradients = allreduce
    assert code == 0
    return run_dir


def test_sft_reproduces_the_default_runs_pinned_losses(default_run):
    """Also: one rank without ZeRO runs no gradient all-reduce (train.skip_identity_allreduce), and the pinned
    numbers (recorded when it still ran) are unchanged: skipping it is an identity."""
    assert ALLREDUCES == []
    rows = [json.loads(line) for line in (default_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = {r["step"]: r for r in rows if "eval_loss" in r}
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in train] == pytest.approx(PINNED_LOSS, rel=1e-5)
    assert [r["grad_norm"] for r in train] == pytest.approx(PINNED_GRAD_NORM, rel=1e-4)
    assert 0 in evals  # issue 24: the starting point (trainer.eval_at_start), before the pinned evaluations
    assert {s: evals[s]["eval_loss"] for s in PINNED_EVAL} == pytest.approx(PINNED_EVAL, rel=1e-5)
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals.values())
    assert evals[6]["eval_accuracy"] > evals[3]["eval_accuracy"]
