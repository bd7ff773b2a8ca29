"""Evaluation and model selection without a process group: the per-batch sums, the padding forwards, the eval-sample
cut, the eval ledger check, the save_best / early stopping rules and their config rules.
(Real runs: tests/test_eval_runs.py; SmolLM2's step-0 evaluation: tests/test_smollm2.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from dsrecipes.core.schema import SelectMetric
from dsrecipes.data.strategies.eval import limit_rows
from dsrecipes.objectives.sft import SFT, EvalResult, collate, token_sums
from dsrecipes.rank.evaluation import EvalLedger, evaluate, verify_eval_ledgers
from dsrecipes.rank.selection import METRIC_MODES, Selector


def batch_sums(logits, labels, position_ids=None):
    """SFT's per-micro-batch eval sums (objectives/sft.py), as the evaluation adds them."""
    return token_sums(logits, labels, position_ids, count_correct=True)


def test_batch_sums_count_the_shifted_labels_and_skip_packing_boundaries():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, 3, 4, -100, 1], [-100, -100, 2, 6, 5]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]])  # row 2 packs two samples: token 2 starts one
    loss_sum, tokens, correct = batch_sums(logits, labels, position_ids)
    want = [(0, 0, 3), (0, 1, 4), (0, 3, 1), (1, 2, 6), (1, 3, 5)]  # (row, predicting position, label)
    assert int(tokens) == len(want)
    manual = sum(float(-torch.log_softmax(logits[r, t], -1)[y]) for r, t, y in want)
    assert math.isclose(float(loss_sum), manual, rel_tol=1e-5)
    assert int(correct) == sum(int(logits[r, t].argmax()) == y for r, t, y in want)
    hit = torch.full((1, 3, 4), -5.0)
    hit[0, 0, 2] = hit[0, 1, 3] = 5.0  # predicts 2 then 3
    assert [int(x) for x in batch_sums(hit, torch.tensor([[-100, 2, 1]]))[1:]] == [2, 1]


def test_result_metrics():
    r = EvalResult(loss_sum=6.0, tokens=4, correct=1)
    assert r.metrics() == {"eval_loss": 1.5, "eval_ppl": math.exp(1.5), "eval_accuracy": 0.25, "eval_tokens": 4}
    assert math.isnan(EvalResult(0.0, 0, 0).loss) and EvalResult(1e6, 1, 0).perplexity == float("inf")


class _Module(torch.nn.Module):
    """Stands in for the engine: a real module with a `device`, counting its forward passes."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 8)
        self.device = torch.device("cpu")
        self.calls = 0

    def forward(self, input_ids, position_ids, attention_mask, use_cache):
        self.calls += 1
        return type("Out", (), {"logits": self.emb(input_ids)})()


def test_evaluate_sums_every_batch_and_records_the_scored_ids(tmp_path):
    rows = [{"ids": [f"s{i}"], "input_ids": [1, 2, 3, i % 8], "labels": [-100, 2, 3, i % 8]} for i in range(5)]
    batches = [collate(rows[:2], 0), collate(rows[2:4], 0), collate(rows[4:], 0)]
    model = _Module()
    ledger = EvalLedger(tmp_path, 0)
    result = evaluate(SFT(0), model, batches, ledger, step=7)
    ledger.close()
    assert model.calls == 3 and result["eval_tokens"] == 15
    with torch.no_grad():
        want = sum(float(batch_sums(model.emb(b["input_ids"]), b["labels"], b["position_ids"])[0]) for b in batches)
    assert math.isclose(result["eval_loss"] * 15, want, rel_tol=1e-9)
    lines = [json.loads(x) for x in (tmp_path / "ledger" / "eval_rank0.jsonl").read_text().splitlines()]
    assert lines[-1] == {"step": 7, "ids": [f"s{i}" for i in range(5)]}
    assert verify_eval_ledgers(tmp_path, [f"s{i}" for i in range(5)]) == []
    assert "not the same set" in verify_eval_ledgers(tmp_path, ["s0"])[0]


def test_eval_ledgers_catch_a_sample_scored_twice_and_a_resumed_session_replaces_its_repeats(tmp_path):
    for rank, ids in ((0, ["a", "b"]), (1, ["c", "b"])):
        with_ledger = EvalLedger(tmp_path, rank)
        with_ledger.record(0, ids)
        with_ledger.close()
    (problem,) = verify_eval_ledgers(tmp_path)
    assert "1 samples scored more than once" in problem and "'b'" in problem
    ok = tmp_path / "ok"
    for rank, ids in ((0, ["a", "b"]), (1, ["c"])):
        ledger = EvalLedger(ok, rank)
        ledger.record(0, ids)
        ledger.record(4, ids)
        ledger.close()
        again = EvalLedger(ok, rank)  # resumed from step 0: its evaluation at step 4 replaces the first one's
        again.record(4, ids)
        again.close()
    assert verify_eval_ledgers(ok, ["a", "b", "c"]) == []


def test_limit_rows_takes_the_first_samples_and_whole_packed_rows():
    rows = [{"ids": ["a"]}, {"ids": ["b", "c"]}, {"ids": ["d"]}]
    assert limit_rows(rows, None) is rows
    assert limit_rows(rows, 1) == rows[:1] and limit_rows(rows, 2) == rows[:2] and limit_rows(rows, 3) == rows[:2]
    assert limit_rows(rows, 99) == rows


def test_every_select_metric_has_a_direction():
    assert set(METRIC_MODES) == set(SelectMetric)


def _selector(make_cfg, *overrides):
    state = {}
    return Selector(make_cfg(*overrides), state), state


def test_save_best_and_patience_rules(make_cfg):
    sel, state = _selector(make_cfg, "trainer.save_best.enabled=true", "trainer.early_stopping.patience=2",
                           "trainer.early_stopping.min_delta=0.1")
    assert sel.observe(0, {"eval_loss": 0.1}).improved is False and state["best_step"] is None  # the start: baseline
    assert sel.observe(2, {"eval_loss": 3.0}).improved and sel.protected() == ["step_2"]
    v = sel.observe(4, {"eval_loss": 2.95})  # better (the new best), but not by min_delta: patience counts
    assert v.improved and state["bad_evals"] == 1 and v.stop is None and sel.protected() == ["step_4"]
    v = sel.observe(6, {"eval_loss": float("nan")})
    assert not v.improved and state["bad_evals"] == 2 and v.stop.startswith("early stopping: eval_loss did not")
    assert sel.outcome() == {"best_metric": "eval_loss", "best_step": 4, "best_value": 2.95, "stopped_early": v.stop}
    resumed = Selector(make_cfg("trainer.save_best.enabled=true"), json.loads(json.dumps(state)))
    assert resumed.protected() == ["step_4"] and resumed.state["bad_evals"] == 2


def test_accuracy_is_maximised_and_an_explicit_mode_wins(make_cfg):
    sel, state = _selector(make_cfg, "trainer.save_best.enabled=true", "trainer.save_best.metric=eval_accuracy")
    sel.observe(1, {"eval_accuracy": 0.2})
    sel.observe(2, {"eval_accuracy": 0.1})
    assert state["best_step"] == 1
    sel, state = _selector(make_cfg, "trainer.save_best.enabled=true", "trainer.save_best.mode=max")
    sel.observe(1, {"eval_loss": 1.0})
    sel.observe(2, {"eval_loss": 2.0})
    assert state["best_step"] == 2


def test_selection_off_keeps_nothing(make_cfg):
    sel, state = _selector(make_cfg)
    assert not sel.observe(3, {"eval_loss": 1.0}).improved and sel.protected() == [] and sel.outcome() == {}


@pytest.mark.parametrize("override, message", [
    ("trainer.eval_batches=2", "trainer.eval_batches: replaced by trainer.eval_samples"),
    ("trainer.eval_samples=0", "trainer.eval_samples: a number of samples >= 1"),
    ("trainer.early_stopping.patience=-1", "trainer.early_stopping.patience"),
    ("trainer.early_stopping.min_delta=-0.5", "trainer.early_stopping.min_delta"),
])
def test_config_rules(make_cfg, override, message):
    from dsrecipes.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(override, check_files=False)
    assert message in str(err.value)


def test_held_out_prompts_cut_each_sample_at_its_last_trained_span():
    from dsrecipes.rank.gen_eval import held_out_prompts, samples_of

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(f"t{i}" for i in ids if not (skip_special_tokens and i == 9))

    # one plain row (two replies: the last one is the reference) and one packed row of two samples
    plain = {"input_ids": [1, 2, 3, 4, 9, 5, 6, 7, 9], "labels": [-100, -100, 3, 4, 9, -100, -100, 7, 9]}
    packed = {"input_ids": [1, 2, 9, 1, 3, 4, 9], "labels": [-100, 2, 9, -100, -100, 4, 9],
              "position_ids": [0, 1, 2, 0, 1, 2, 3]}
    assert [s["input_ids"] for s in samples_of(packed)] == [[1, 2, 9], [1, 3, 4, 9]]
    prompts = held_out_prompts([plain, packed], 10, Tok(), stop_ids=[9])
    assert [(p.ids, p.reference) for p in prompts] == [([1, 2, 3, 4, 9, 5, 6], "t7"), ([1], "t2"), ([1, 3], "t4")]
    assert len(held_out_prompts([plain, packed], 2, Tok(), stop_ids=[9])) == 2
    untrained = {"input_ids": [1, 2], "labels": [-100, -100]}
    whole = {"input_ids": [1, 2], "labels": [1, 2]}
    assert held_out_prompts([untrained, whole], 10, Tok(), stop_ids=[9]) == []


@pytest.mark.parametrize("override, message", [
    ("trainer.save_best.metric=prompt_similarity", "trainer.save_best.metric: prompt_similarity comes from"),
    ("trainer.prompt_eval_every=5 data=iterable", "trainer.prompt_eval_every: prompts come from the prepared"),
    ("trainer.prompt_eval_every=5 data.train_on=all", "trainer.prompt_eval_every: with data.train_on=all"),
])
def test_prompt_eval_config_rules(make_cfg, override, message):
    from dsrecipes.core.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        make_cfg(*override.split(), check_files=False)
    assert message in str(err.value)
