"""`objective.loss_average` (SFT): `tokens` (the default) weighs each trained token of an optimizer step the same,
whatever micro-batch and rank it lands in (rank/step_tokens.py); `micro_batches` averages micro-batch means.

The hostile check is end to end through `python -m dsrecipes`: two conversations whose answers differ tenfold in
length trained as one step of one micro-batch of 2, as 2 accumulated micro-batches of 1, and on 2 ranks with 1 each
(the deepspeed launcher, gloo). With `tokens` the step's logged loss and gradient norm are the same all three ways
(the same gradient); with `micro_batches` the accumulated step differs (the short answer's tokens weigh ten times
more), which is what the default used to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsrecipes.rank.step_tokens import weigh_steps
from tests.test_train_runs import metrics, train_run

LABELS = lambda batch: batch["num_label_tokens"]  # noqa: E731 (SFT's `tokens`: its collated count)


def test_weigh_steps_gives_each_step_grad_accum_over_its_token_count():
    batches = [{"num_label_tokens": n} for n in (3, 5, 0, 0, 7)]  # steps of 2: 8 tokens, none, then 7 (short)
    weighed = list(weigh_steps(batches, grad_accum=2, world_size=1, count=LABELS))
    assert [b["token_weight"] for b in weighed] == [2 / 8, 2 / 8, 2.0, 2.0, 2 / 7]


def test_sft_loss_with_token_weights_gives_the_gradient_of_the_joint_batch(make_cfg):
    """Two micro-batches of one row each (answers of 2 and 20 tokens), each loss divided by grad_accum as DeepSpeed
    does: with the loop's token weights the summed gradient is the joint batch's token mean; without, it is not."""
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.modeling.model import build_tiny_model
    from dsrecipes.objectives.sft import SFT, collate

    cfg = make_cfg("debug=fast", check_files=False)
    model = build_tiny_model(cfg, load_tokenizer(cfg))
    rows = [{"ids": ["a"], "input_ids": list(range(5, 13)), "labels": [-100] * 6 + [9, 10]},
            {"ids": ["b"], "input_ids": list(range(5, 31)), "labels": [-100] * 6 + list(range(11, 31))}]
    sft, cpu = SFT(pad_id=0), torch.device("cpu")

    def grad(batches) -> torch.Tensor:
        model.zero_grad()
        for batch in batches:
            (sft.loss(model, batch, cpu)[0] / len(batches)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()

    joint = grad([collate(rows, 0)])
    weighed = grad(list(weigh_steps([collate([r], 0) for r in rows], grad_accum=2, world_size=1, count=LABELS)))
    means = grad([collate([r], 0) for r in rows])
    assert torch.allclose(weighed, joint, atol=1e-6, rtol=1e-4)
    assert not torch.allclose(means, joint, atol=1e-4, rtol=1e-2)


def two_conversations(path: Path) -> Path:
    short = {"conversations": [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "4"}]}
    story = " ".join(f"Step {i}: add {i} apples to the basket and count them again." for i in range(1, 9))
    long = {"conversations": [{"from": "human", "value": "Tell me how to count apples."}, {"from": "gpt", "value": story}]}
    path.write_text("".join(json.dumps(row) + "\n" for row in (short, long)))
    return path


@pytest.mark.slow
def test_one_step_trained_three_ways_has_one_loss_and_gradient(tmp_path):
    data = two_conversations(tmp_path / "two.jsonl")
    common = ["dataset=sharegpt_files", f"dataset.paths=[{data}]", "dataset.val_size=0", "dataset.max_samples=null",
              "trainer.max_steps=null", "trainer.epochs=1", "trainer.eval_every=0", "trainer.export=false",
              "trainer.report_to=[]", "data.cutoff_len=192"]

    def step1(name: str, *overrides: str, world_size: int = 1) -> tuple:
        run, _ = train_run(tmp_path, name, *common, *overrides, world_size=world_size)
        (row,) = [r for r in metrics(run) if "loss" in r]
        assert row["step"] == 1 and row["samples_seen"] == 2
        return row["loss"], row["grad_norm"]

    joint = step1("joint", "trainer.micro_batch_size=2", "trainer.grad_accum=1")
    accumulated = step1("accum", "trainer.micro_batch_size=1", "trainer.grad_accum=2")
    ranks = step1("ranks", "trainer.micro_batch_size=1", "trainer.grad_accum=1", world_size=2)
    means = step1("means", "trainer.micro_batch_size=1", "trainer.grad_accum=2", "objective.loss_average=micro_batches")
    assert accumulated == pytest.approx(joint, rel=1e-4) and ranks == pytest.approx(joint, rel=1e-4)
    # (at the seeded start every token's loss is near ln(vocab), so the losses differ by ~1.5%, the gradients by ~75%)
    assert means[0] != pytest.approx(joint[0], rel=1e-3) and means[1] != pytest.approx(joint[1], rel=0.2)
