"""objective=reward: the Bradley-Terry loss against TRL's RewardTrainer, the scalar head (full and LoRA), pairs under
every reading strategy (once per epoch over 2 ranks, equal steps, resume), and a tiny run end to end: train (held-out
accuracy and margin at step 0 and after) -> export (a sequence-classification directory transformers loads) ->
`dsrecipes score` (accuracy printed, rewards written; refusals exit 2 with one message).

TRL 1.16 (installed) is the reference: `RewardTrainer.compute_loss`, unbound, on the same tiny model and batch.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from dsrecipes.modeling.model import build_model, load_tokenizer
from dsrecipes.objectives import build_objective
from tests.conftest import in_process_environ
from tests.test_dpo import TRL_FORMAT, TRL_ROWS, encode, write_jsonl

RewardTrainer = pytest.importorskip("trl.trainer.reward_trainer").RewardTrainer
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def reward_setup(tmp_path_factory):
    from dsrecipes.config.load import compose_and_load

    path = write_jsonl(tmp_path_factory.mktemp("trl") / "pairs.jsonl", TRL_ROWS)
    cfg = compose_and_load(["objective=reward", *TRL_FORMAT, f"dataset.paths=[{path}]"], check_files=False)
    tokenizer = load_tokenizer(cfg)
    rows, _ = encode(cfg, tokenizer)
    return cfg, tokenizer, build_model(cfg, tokenizer), rows


def trl_loss(model, batch, center, margin=None):
    """TRL's RewardTrainer.compute_loss on our batch (its inputs: input_ids, attention_mask[, margin])."""
    fake = SimpleNamespace(model=model, args=SimpleNamespace(center_rewards_coefficient=center), _tp_size=1,
                           _total_train_tokens=0, _metrics={m: defaultdict(list) for m in ("train", "eval")},
                           accelerator=SimpleNamespace(gather_for_metrics=lambda t: t, gather=lambda t: t))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if margin is not None:
        inputs["margin"] = margin
    return RewardTrainer.compute_loss(fake, model, inputs), fake._metrics["train"]


@pytest.mark.parametrize("center,margin", [(None, None), (0.01, [0.5, -0.25, 1.0])])
def test_loss_equals_trl_reward_trainer(reward_setup, center, margin):
    cfg, tokenizer, model, rows = reward_setup
    objective = build_objective(cfg, tokenizer)
    objective.center = center
    if margin is not None:
        rows = [dict(r, margin=m) for r, m in zip(rows, margin)]
    batch = objective.collate(rows)
    model.train()
    want, trl_metrics = trl_loss(model, batch, center, batch.get("margin"))
    got, sums = objective.loss(model, batch, CPU)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    metrics = objective.metrics({k: float(v) for k, v in sums.items()}, "")
    assert metrics["reward_accuracy"] == pytest.approx(trl_metrics["accuracy"][0], rel=1e-6)
    assert metrics["reward_margin"] == pytest.approx(trl_metrics["margin"][0], rel=1e-5, abs=1e-7)
    got.backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_scores_read_the_last_non_pad_token_and_an_empty_batch_trains_nothing(reward_setup):
    """A sequence scored in a padded batch scores as it does alone (HF pooling by config.pad_token_id)."""
    from dsrecipes.objectives.reward import scores

    cfg, tokenizer, model, rows = reward_setup
    objective = build_objective(cfg, tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None and model.config.num_labels == 1
    model.eval()
    together = scores(model, objective.collate(rows), CPU)
    alone = torch.cat([scores(model, objective.collate([r]), CPU) for r in rows]).view(len(rows), 2).T.reshape(-1)
    assert torch.allclose(together, alone, atol=1e-5)
    loss, sums = objective.loss(model, objective.collate([]), CPU)
    assert float(loss) == 0.0 and float(sums["pairs"]) == 0


def test_lora_trains_the_score_head_and_validation_names_keys(reward_setup):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.errors import ConfigError

    cfg, tokenizer, _, _ = reward_setup
    lora = compose_and_load(["objective=reward", "model.lora.enabled=true"], check_files=False)
    model = build_model(lora, tokenizer)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable) and any("lora_" in n for n in trainable)
    assert not any("embed_tokens" in n for n in trainable)
    with pytest.raises(ConfigError) as err:
        compose_and_load(["objective=reward", "objective.center_rewards_coefficient=-1",
                          "trainer.prompt_eval_every=5"], check_files=False)
    assert "objective.center_rewards_coefficient" in str(err.value) and "trainer.prompt_eval_every" in str(err.value)


@pytest.mark.parametrize("kind", ["map", "iterable", "presharded"])
def test_reward_pairs_once_equal_steps_and_resume_under_every_strategy(kind, tmp_path):
    """The data layer serves the reward objective by its row kind: 2 ranks read every pair once per epoch in equal
    micro-batch counts, and a loader resumed from its state yields exactly the rest."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.data.shard.build import shard
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    base = ["objective=reward", "dataset=sample_pairs", "dataset.max_samples=24", "dataset.val_size=4",
            "data.cutoff_len=256", "trainer.micro_batch_size=2", f"data.cache_dir={tmp_path / 'cache'}"]
    data = [f"data={kind}"]
    if kind == "presharded":
        shard(compose_and_load(base), 2, str(tmp_path / "parts"), val_size=4)
        data += [f"data.shard_dir={tmp_path / 'parts'}"]
    cfg = compose_and_load(base + data)
    tok = load_tokenizer(cfg)
    plan = plan_like_launcher(cfg, tmp_path / "run", 2)
    built = [build_loaders(cfg, tok, r, 2, tmp_path / "run", plan) for r in range(2)]
    per_rank, held = [], [i for _, ev in built for b in ev for i in b["ids"]]
    for lo, _ in built:
        lo.set_epoch(0)
        batches = [b for b in lo]
        assert all(b["input_ids"].shape[0] == 2 * len(b["pair_mask"]) for b in batches)
        per_rank.append([b["ids"] for b in batches])
    got = [i for ids in per_rank for b in ids for i in b]
    assert len(got) == len(set(got)) >= 16 and len({len(ids) for ids in per_rank}) == 1
    assert len(held) == 4 and not set(held) & set(got)
    lo = built[0][0]
    lo.set_epoch(1)
    lo.set_epoch(0)
    it = iter(lo)
    next(it), next(it)
    again, _ = build_loaders(cfg, tok, 0, 2, tmp_path / "run", plan)
    again.load_state_dict(lo.state_dict())
    assert [b["ids"] for b in again] == per_rank[0][2:]


@pytest.fixture(scope="module")
def reward_export(tmp_path_factory):
    """A tiny reward model trained on the bundled pairs (evaluated at step 0 and after), exported."""
    from dsrecipes.cli import main

    tmp = tmp_path_factory.mktemp("reward")
    run_dir = tmp / "run"
    with in_process_environ():
        code = main(["objective=reward", "data=iterable", "dataset=sample_pairs", "dataset.max_samples=40",
                     "dataset.val_size=8",
                     "data.cutoff_len=256", "trainer.micro_batch_size=4", "trainer.log_every=1", "scheduler=constant",
                     "optimizer.lr=3e-3", "trainer.max_steps=8", "trainer.eval_every=4", "trainer.save_every=100",
                     f"data.cache_dir={tmp / 'cache'}", f"trainer.output_dir={run_dir}", f"hydra.run.dir={run_dir}"])
    assert code == 0
    return tmp, run_dir


def test_tiny_reward_run_trains_evaluates_and_exports_a_classifier(reward_export):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, run_dir = reward_export
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_reward_accuracy" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) and "reward_accuracy" in r and "reward_margin" in r for r in train)
    assert [r["step"] for r in evals][:1] == [0] and evals[-1]["step"] == 8
    assert train[-1]["loss"] < train[0]["loss"]  # it learns (8 steps of a random tiny model: held-out is noise)
    assert all(0 <= r["eval_reward_accuracy"] <= 1 and math.isfinite(r["eval_reward_margin"]) for r in evals)
    export = next(p.parent for p in run_dir.rglob("config.json") if "export" in str(p.parent))
    model = AutoModelForSequenceClassification.from_pretrained(export)
    tok = AutoTokenizer.from_pretrained(export)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id is not None
    enc = tok(["hello there", "a longer text to score"], padding=True, return_tensors="pt")
    assert model(**enc).logits.shape == (2, 1)


def test_score_prints_accuracy_and_writes_rewards(reward_export, capsys):
    from dsrecipes.cli import main

    tmp, run_dir = reward_export
    export = next(p.parent for p in run_dir.rglob("config.json") if "export" in str(p.parent))
    pairs = write_jsonl(tmp / "held.jsonl", TRL_ROWS)
    assert main(["score", str(export), "--pairs", str(pairs), "--out", str(tmp / "r.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "pairs 3" in out and "reward_accuracy" in out and "reward_margin" in out
    rewards = [json.loads(line) for line in (tmp / "r.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rewards] == [1, 2, 3]
    assert all(math.isfinite(r["chosen_reward"]) and r["correct"] == (r["chosen_reward"] > r["rejected_reward"])
               for r in rewards)
    # the same numbers as training reads: the pairs encoded by the data layer, scored through the objective
    from transformers import AutoModelForSequenceClassification

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.objectives.reward import scores

    cfg = compose_and_load(["objective=reward", *TRL_FORMAT, f"dataset.paths=[{pairs}]"], check_files=False)
    tok = load_tokenizer(cfg)
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    with torch.no_grad():
        trained = scores(model, build_objective(cfg, tok).collate(encode(cfg, tok)[0]), CPU).view(2, -1)
    assert [r["chosen_reward"] for r in rewards] == pytest.approx(trained[0].tolist(), abs=1e-4)
    assert [r["rejected_reward"] for r in rewards] == pytest.approx(trained[1].tolist(), abs=1e-4)
    # refusals: one message, exit 2, nothing written
    bad = tmp / "bad.jsonl"
    bad.write_text(json.dumps(TRL_ROWS[0]) + "\n" + json.dumps({"prompt": TRL_ROWS[0]["prompt"]}) + "\n")
    assert main(["score", str(export), "--pairs", str(bad), "--out", str(tmp / "x.jsonl")]) == 2
    assert f"{bad}:2: missing_side" in capsys.readouterr().err and not (tmp / "x.jsonl").exists()
    assert main(["score", str(tmp), "--pairs", str(pairs), "--out", str(tmp / "y.jsonl")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    assert main(["score", str(export), "--pairs", str(pairs), "--out", str(tmp / "r.jsonl")]) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["map", "iterable", "presharded"])
def test_a_margin_column_reaches_the_loss_under_every_strategy(kind, tmp_path):
    """TRL's per-pair `margin` column is read with the pair, kept by `dsrecipes shard`, and batched; a margin that is
    not a finite number is a bad row named by file:line."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.errors import DataError
    from dsrecipes.data.shard.build import shard
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    rows = [dict(r, margin=m) for r, m in zip(TRL_ROWS * 2, [0.5, 1, 2.0, 0, 0.25, 3])]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    base = ["objective=reward", *TRL_FORMAT, f"dataset.paths=[{path}]", "trainer.micro_batch_size=6",
            f"data.cache_dir={tmp_path / 'cache'}"]
    data = [f"data={kind}"]
    if kind == "presharded":
        shard(compose_and_load(base), 1, str(tmp_path / "parts"))
        data += [f"data.shard_dir={tmp_path / 'parts'}"]
    cfg = compose_and_load(base + data)
    tok = load_tokenizer(cfg)
    train, _ = build_loaders(cfg, tok, 0, 1, tmp_path / "run", plan_like_launcher(cfg, tmp_path / "run", 1))
    train.set_epoch(0)
    batch = next(iter(train))
    by_id = {f"pairs.jsonl:{i + 1}": float(r["margin"]) for i, r in enumerate(rows)}
    assert batch["margin"].tolist() == [by_id[i.rsplit("/", 1)[-1]] for i in batch["ids"]]
    if kind == "map":
        bad = write_jsonl(tmp_path / "bad.jsonl", [rows[0], dict(rows[1], margin="wide")])
        with pytest.raises(DataError, match=r"bad.jsonl:2.*bad_value.*margin"):
            encode(compose_and_load(["objective=reward", *TRL_FORMAT, f"dataset.paths=[{bad}]"]), tok)


# A reward model scores; it does not write. Was (tried: `dsrecipes debug=fast objective=reward dataset=sample_pairs
# data.cutoff_len=512 trainer.max_steps=2`): the summary's next commands were `compare: dsrecipes prompt-eval ...`
# and `chat: dsrecipes chat RUN`; chat loaded the LlamaForSequenceClassification export with AutoModelForCausalLM
# (transformers' 'UNEXPECTED: score.weight' report on the console) and answered 256 tokens of noise; prompt-eval
# scored that noise against the references. Now the summary names `dsrecipes score`, and chat / prompt-eval refuse
# the export with that command before transformers reads it (serve/inference.check_loadable).
def test_the_summary_of_a_reward_run_names_score_not_chat(reward_export):
    from dsrecipes.observe.report import next_commands

    _, run_dir = reward_export
    said = dict(next_commands(run_dir, ["objective=reward"], 8, 8))
    assert said["score pairs:"] == f"dsrecipes score {run_dir / 'export'} --pairs PAIRS.jsonl", said
    assert "chat:" not in said and "compare:" not in said, said


@pytest.mark.parametrize("argv", [["chat", "{run}", "--message", "hi"], ["chat", "{run}/export", "--message", "hi"],
                                  ["prompt-eval", "--finetuned", "{run}"],
                                  ["prompt-eval", "--baseline", "{run}", "--finetuned", "{run}"]])
def test_chat_and_prompt_eval_refuse_a_reward_model_naming_score(reward_export, argv, capsys):
    from tests.test_messages_hostile import refused

    _, run_dir = reward_export
    err = refused(capsys, [a.format(run=run_dir) for a in argv],
                  f"{run_dir / 'export'}: a reward model (LlamaForSequenceClassification",
                  f"dsrecipes score {run_dir / 'export'} --pairs PAIRS.jsonl")
    assert "UNEXPECTED" not in err  # refused before transformers loaded anything
