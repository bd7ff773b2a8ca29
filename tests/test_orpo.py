"""objective=orpo: the numbers against TRL's ORPOTrainer, and a tiny run end to end on the CPU.

TRL (trl.experimental.orpo, installed) is the reference: on the same log-probs our odds-ratio term equals
`ORPOTrainer.odds_ratio_loss`, and on the same tiny model and batch our loss equals TRL's
`policy_nll_loss - losses.mean()` with TRL's own pieces (`get_batch_logps(average_log_prob=True)` over the answer
tokens, the chosen NLL over prompt and answer, `odds_ratio_loss`), rel 1e-5.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from dsrecipes.modeling.model import build_model, load_tokenizer
from dsrecipes.objectives import build_objective
from dsrecipes.objectives.orpo import odds_ratio
from tests.conftest import in_process_environ
from tests.test_dpo import TRL_FORMAT, TRL_ROWS, encode, write_jsonl

ORPOTrainer = pytest.importorskip("trl.experimental.orpo.orpo_trainer").ORPOTrainer


def trl_odds_ratio_loss(beta: float, chosen: torch.Tensor, rejected: torch.Tensor):
    """TRL's method, unbound, with the two attributes it reads."""
    fake = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=torch.device("cpu")))
    return ORPOTrainer.odds_ratio_loss(fake, chosen, rejected)


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_odds_ratio_equals_trl_on_the_same_logps(beta):
    g = torch.Generator().manual_seed(0)
    chosen = -torch.rand(64, generator=g, dtype=torch.float64).float() * 4 - 1e-3  # both sides of TRL's -ln 2 branch
    rejected = -torch.rand(64, generator=g, dtype=torch.float64).float() * 4 - 1e-3
    nll = torch.tensor(1.7)
    losses, chosen_rewards, _, ratio_mean, log_odds_mean = trl_odds_ratio_loss(beta, chosen, rejected)
    log_odds, log_ratio = odds_ratio(chosen, rejected)
    ours = nll + beta * (-log_ratio).mean()
    assert float(ours) == pytest.approx(float(nll - losses.mean()), rel=1e-5)
    assert float(log_ratio.mean()) == pytest.approx(float(ratio_mean), rel=1e-5)
    assert float(log_odds.mean()) == pytest.approx(float(log_odds_mean), rel=1e-5)


@pytest.fixture(scope="module")
def orpo_setup(tmp_path_factory):
    from dsrecipes.config.load import compose_and_load

    path = write_jsonl(tmp_path_factory.mktemp("trl") / "pairs.jsonl", TRL_ROWS)
    cfg = compose_and_load(["objective=orpo", *TRL_FORMAT, f"dataset.paths=[{path}]"], check_files=False)
    tokenizer = load_tokenizer(cfg)
    rows, _ = encode(cfg, tokenizer)
    return cfg, tokenizer, build_model(cfg, tokenizer), rows


def trl_loss(model, batch, beta: float):
    """TRL's ORPO loss and metrics on our batch (its `concatenated_forward` + `get_batch_loss_metrics`)."""
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    n = len(batch["pair_mask"])
    labels = torch.where(batch["attention_mask"] == 1, batch["input_ids"], -100)
    nll = nn.CrossEntropyLoss()(logits[:n, :-1].reshape(-1, logits.shape[-1]), labels[:n, 1:].reshape(-1))
    logps = ORPOTrainer.get_batch_logps(logits, batch["labels"], average_log_prob=True)
    losses, chosen_rewards, rejected_rewards, ratio_mean, log_odds_mean = trl_odds_ratio_loss(
        beta, logps[:n], logps[n:])
    return nll - losses.mean(), {"nll_loss": float(nll), "log_odds_ratio": float(ratio_mean),
                                 "log_odds_chosen": float(log_odds_mean),
                                 "rewards_chosen": float(chosen_rewards.mean()),
                                 "rewards_rejected": float(rejected_rewards.mean()),
                                 "logps_chosen": float(logps[:n].mean()), "logps_rejected": float(logps[n:].mean())}


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_loss_and_metrics_equal_trl_on_a_model(orpo_setup, beta):
    cfg, tokenizer, model, rows = orpo_setup
    objective = build_objective(cfg, tokenizer)
    objective.beta = beta
    batch = objective.collate(rows)
    model.train()
    want, want_metrics = trl_loss(model, batch, beta)
    got, sums = objective.loss(model, batch, torch.device("cpu"))
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    metrics = objective.metrics({k: float(v) for k, v in sums.items()}, "")
    for key, value in want_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    got.backward()  # the loss carries the gradient
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()


def test_an_empty_micro_batch_trains_nothing(orpo_setup):
    cfg, tokenizer, model, _ = orpo_setup
    objective = build_objective(cfg, tokenizer)
    batch = objective.collate([])
    loss, sums = objective.loss(model, batch, torch.device("cpu"))
    assert float(loss) == 0.0 and float(sums["pairs"]) == 0


@pytest.mark.slow
def test_tiny_orpo_run_end_to_end(tmp_path):
    """`python -m dsrecipes objective=orpo` on the bundled pairs: trains, evaluates, computes no reference."""
    from dsrecipes.cli import main

    run_dir = tmp_path / "run"
    with in_process_environ():
        code = main(["objective=orpo", "dataset=sample_pairs", "dataset.max_samples=24", "dataset.val_size=4",
                     "data.cutoff_len=256", "trainer.micro_batch_size=4", "trainer.log_every=1", "scheduler=constant",
                     "optimizer.lr=3e-3", "trainer.max_steps=6", "trainer.eval_every=3", "trainer.save_every=100",
                     "trainer.export=false", f"data.cache_dir={tmp_path / 'cache'}", f"trainer.output_dir={run_dir}",
                     f"hydra.run.dir={run_dir}"])
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) and "nll_loss" in r and "log_odds_ratio" in r for r in train)
    assert train[-1]["loss"] < train[0]["loss"]
    assert evals and all(math.isfinite(r["eval_loss"]) and "eval_reward_accuracy" in r for r in evals)
    stats = json.loads((run_dir / "prepare_stats.json").read_text())
    assert stats["row_kind"] == "pair" and "reference_dir" not in stats
    assert not (tmp_path / "cache" / "prepared" / stats["cache_key"] / "reference").exists()


@pytest.mark.parametrize("kind", ["iterable", "map"])
def test_orpo_reads_pairs_under_every_reading_strategy(kind, tmp_path):
    """The data layer serves ORPO by its row kind alone: pairs under data=map and data=iterable, no reference."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    cfg = compose_and_load(["objective=orpo", f"data={kind}", "dataset=sample_pairs", "dataset.max_samples=20",
                            "dataset.val_size=4", "data.cutoff_len=256", "trainer.micro_batch_size=2",
                            f"data.cache_dir={tmp_path / 'cache'}"])
    tok = load_tokenizer(cfg)
    plan = plan_like_launcher(cfg, tmp_path / "run", 1)
    train, evals = build_loaders(cfg, tok, 0, 1, tmp_path / "run", plan)
    train.set_epoch(0)
    batch = next(iter(train))
    assert batch["input_ids"].shape[0] == 2 * len(batch["pair_mask"]) and "ref_chosen_logps" not in batch
    model = build_model(cfg, tok)
    loss, sums = build_objective(cfg, tok).loss(model, batch, torch.device("cpu"))
    assert math.isfinite(float(loss)) and float(sums["pairs"]) == len(batch["ids"])
    assert sum(len(b["ids"]) for b in evals) == 4
