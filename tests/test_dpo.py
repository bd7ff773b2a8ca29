"""objective=dpo: preference rows and their bad rows, truncation, and the numbers against TRL's DPOTrainer.

TRL is the reference implementation people compare with: on the same tiny model, reference model and batch, our
loss, chosen/rejected log-probs, rewards, reward accuracy and margin must equal what `DPOTrainer._compute_loss`
reports (TRL's own collator on our token rows). The tokenization is compared too: the prompt tokens equal TRL's, and
the answers equal TRL's up to the template's text after the end-of-turn token (we stop at `<|im_end|>`, TRL keeps
the newline the chat template writes after it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsrecipes.core.errors import ConfigError, DataError
from dsrecipes.core.schema import DpoLoss
from dsrecipes.data.render.preference_encode import read_and_encode_pairs
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.modeling.model import build_model, load_tokenizer
from dsrecipes.objectives import build_objective
from dsrecipes.objectives.dpo_live import LiveReference

TRL_ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
     "chosen": [{"role": "assistant", "content": "2 + 2 = 4."}],
     "rejected": [{"role": "assistant", "content": "2 + 2 = 5."}]},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"}],
     "chosen": [{"role": "assistant", "content": "Rome."}],
     "rejected": [{"role": "assistant", "content": "Milan, of course. It is the largest city."}]},
    {"prompt": [{"role": "user", "content": "Reverse the word 'cat'."}],
     "chosen": [{"role": "assistant", "content": "tac"}],
     "rejected": [{"role": "assistant", "content": "act"}]},
]
TRL_FORMAT = ["dataset=openai_messages", "dataset.val_size=0"]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def encode(cfg, tokenizer):
    report = BadRowReport(cfg.dataset.bad_rows, 1.0)
    rows, _ = read_and_encode_pairs(cfg, tokenizer, resolve_sources(cfg.dataset), report)
    return rows, report


@pytest.fixture(scope="module")
def trl_setup(tmp_path_factory):
    from dsrecipes.config.load import compose_and_load

    path = write_jsonl(tmp_path_factory.mktemp("trl") / "pairs.jsonl", TRL_ROWS)
    cfg = compose_and_load(["objective=dpo", *TRL_FORMAT, f"dataset.paths=[{path}]"], check_files=False)
    tokenizer = load_tokenizer(cfg)
    policy = build_model(cfg, tokenizer)
    reference = build_model(compose_and_load(["model.tiny.seed=7"], check_files=False), tokenizer)
    rows, _ = encode(cfg, tokenizer)
    return cfg, tokenizer, policy, reference, rows


def trl_numbers(trl_setup, tmp_path, loss: str, beta: float, ls: float, swap: bool = False):
    """TRL's loss and metrics on our token rows (`swap`: chosen and rejected exchanged)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    _, tokenizer, policy, reference, rows = trl_setup
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[loss], label_smoothing=ls,
                     report_to=[], use_cpu=True, max_length=None, bf16=False)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(TRL_ROWS),
                         processing_class=tokenizer)
    sides = ("rejected", "chosen") if swap else ("chosen", "rejected")
    ours = [{"prompt_ids": r["prompt_ids"], "chosen_ids": r[f"{sides[0]}_ids"], "rejected_ids": r[f"{sides[1]}_ids"]}
            for r in rows]
    policy.train()
    loss_value = trainer._compute_loss(policy, trainer.data_collator(ours), return_outputs=False)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss_value.detach()), metrics, trainer


def our_numbers(trl_setup, loss: DpoLoss, beta: float, ls: float, gamma: float = 0.5, reference: bool = True):
    cfg, tokenizer, policy, ref_model, rows = trl_setup
    objective = type(cfg.objective)(kind=cfg.objective.kind, rows=cfg.objective.rows, beta=beta, loss=loss,
                                     label_smoothing=ls, simpo_gamma=gamma)
    cfg = type(cfg)(**{**cfg.__dict__, "objective": objective})
    objective = build_objective(cfg, tokenizer)
    if reference:
        objective.reference = LiveReference(ref_model)
    policy.train()
    value, sums = objective.loss(policy, objective.collate(rows), torch.device("cpu"))
    return float(value), objective.metrics({k: float(v) for k, v in sums.items()}, "")


@pytest.mark.parametrize("loss,beta,ls", [(DpoLoss.sigmoid, 0.1, 0.0), (DpoLoss.sigmoid, 0.5, 0.0),
                                          (DpoLoss.ipo, 0.1, 0.0), (DpoLoss.robust, 0.2, 0.1)])
def test_loss_logps_and_rewards_equal_trl(trl_setup, tmp_path, loss, beta, ls):
    theirs_loss, theirs, _ = trl_numbers(trl_setup, tmp_path, loss.value, beta, ls)
    ours_loss, ours = our_numbers(trl_setup, loss, beta, ls)
    assert ours_loss == pytest.approx(theirs_loss, rel=1e-5, abs=1e-6)
    assert ours["logps_chosen"] == pytest.approx(theirs["logps/chosen"], rel=1e-5)
    assert ours["logps_rejected"] == pytest.approx(theirs["logps/rejected"], rel=1e-5)
    assert ours["rewards_chosen"] == pytest.approx(theirs["rewards/chosen"], rel=1e-4, abs=1e-6)
    assert ours["rewards_rejected"] == pytest.approx(theirs["rewards/rejected"], rel=1e-4, abs=1e-6)
    assert ours["reward_margin"] == pytest.approx(theirs["rewards/margins"], rel=1e-4, abs=1e-6)
    assert ours["reward_accuracy"] == pytest.approx(theirs["rewards/accuracies"])
    assert abs(ours["rewards_chosen"]) > 1e-3  # a different reference model: the rewards are not trivially 0


def trl_simpo_numbers(trl_setup, tmp_path, beta: float, gamma: float, ls: float):
    """TRL's SimPO (CPOTrainer, loss_type="simpo", cpo_alpha=0: no NLL term) on our token rows, collated by us."""
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    _, tokenizer, policy, _, rows = trl_setup
    args = CPOConfig(output_dir=str(tmp_path / "cpo"), beta=beta, loss_type="simpo", simpo_gamma=gamma, cpo_alpha=0.0,
                     label_smoothing=ls, report_to=[], use_cpu=True, bf16=False, max_length=None)
    text = [{k: tokenizer.apply_chat_template(r[k], tokenize=False) for k in ("prompt", "chosen", "rejected")}
            for r in TRL_ROWS]
    trainer = CPOTrainer(model=policy, args=args, train_dataset=Dataset.from_list(text), processing_class=tokenizer)
    ours = build_objective(trl_setup[0], tokenizer).collate(rows)
    half = len(rows)
    batch = {f"{side}_{key}": ours[key][part] for side, part in (("chosen", slice(0, half)),
                                                                   ("rejected", slice(half, None)))
             for key in ("input_ids", "attention_mask", "labels")}
    policy.train()
    loss, metrics = trainer.get_batch_loss_metrics(policy, batch)
    return float(loss.detach()), metrics


@pytest.mark.parametrize("beta,gamma,ls", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.0), (0.7, 0.3, 0.2)])
def test_simpo_equals_trl_cpo_simpo_without_any_reference(trl_setup, tmp_path, beta, gamma, ls):
    """SimPO is reference-free: no reference is set on our objective (a reference call would raise), and the
    numbers still equal TRL's."""
    theirs_loss, theirs = trl_simpo_numbers(trl_setup, tmp_path, beta, gamma, ls)
    ours_loss, ours = our_numbers(trl_setup, DpoLoss.simpo, beta, ls, gamma=gamma, reference=False)
    assert ours_loss == pytest.approx(theirs_loss, rel=1e-5, abs=1e-6)
    for key, trl_key in (("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected"),
                         ("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                         ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies")):
        assert ours[key] == pytest.approx(theirs[trl_key], rel=1e-5, abs=1e-6), key
    assert -20 < ours["logps_chosen"] < 0  # an average per answer token, not a sum


def test_simpo_needs_no_reference_anywhere(make_cfg):
    from dsrecipes.data.prepare.build import precomputed_reference

    simpo = make_cfg("objective=dpo", "objective.loss=simpo", "objective.beta=2", "objective.simpo_gamma=1")
    assert not precomputed_reference(simpo)  # prepare computes and caches no reference log-probs
    objective = build_objective(simpo, load_tokenizer(simpo))
    assert objective.precomputed is False and objective.gamma == 1.0
    objective.attach(simpo, None, None)  # builds nothing (no engine needed)
    assert objective.reference is None
    assert precomputed_reference(make_cfg("objective=dpo"))
    with pytest.raises(ConfigError) as err:
        make_cfg("objective=dpo", "objective.loss=simpo", "objective.reference=live", "objective.simpo_gamma=-1")
    assert "objective.reference" in str(err.value) and "objective.simpo_gamma" in str(err.value)


def test_label_smoothing_is_cdpo_in_trl_terms(trl_setup, tmp_path):
    """Conservative DPO: (1 - ls) x TRL's sigmoid loss + ls x TRL's sigmoid loss with the sides exchanged."""
    straight, _, _ = trl_numbers(trl_setup, tmp_path, "sigmoid", 0.1, 0.0)
    swapped, _, _ = trl_numbers(trl_setup, tmp_path, "sigmoid", 0.1, 0.0, swap=True)
    ours, _ = our_numbers(trl_setup, DpoLoss.sigmoid, 0.1, 0.25)
    assert ours == pytest.approx(0.75 * straight + 0.25 * swapped, rel=1e-5)


def test_tokenization_matches_trl(trl_setup, tmp_path):
    _, tokenizer, _, _, rows = trl_setup
    _, _, trainer = trl_numbers(trl_setup, tmp_path, "sigmoid", 0.1, 0.0)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for ours, theirs in zip(rows, trainer.train_dataset):
        assert ours["prompt_ids"] == theirs["prompt_ids"]
        for side in ("chosen", "rejected"):
            cut = theirs[f"{side}_ids"].index(end) + 1
            assert ours[f"{side}_ids"] == theirs[f"{side}_ids"][:cut]
            assert ours[f"{side}_labels"] == ours[f"{side}_ids"]  # chatml: every answer token is trained


def test_every_malformed_pair_kind_is_a_counted_bad_row_with_its_line(make_cfg, tmp_path):
    good = TRL_ROWS[0]
    bad = [
        {"prompt": good["prompt"], "chosen": good["chosen"]},  # missing_side
        {**good, "rejected": good["chosen"]},  # identical_sides
        {**good, "chosen": [{"role": "assistant", "content": "   "}]},  # empty_answer
        {**good, "rejected": [{"role": "user", "content": "no"}]},  # side_not_assistant
        {**good, "chosen": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {**good, "prompt": [{"role": "user", "content": "word " * 400}]},  # prompt_too_long
        {**good, "prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"chosen": good["chosen"], "rejected": good["rejected"]},  # no prompt
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, *bad, good])
    cfg = make_cfg("objective=dpo", *TRL_FORMAT, f"dataset.paths=[{path}]", "dataset.bad_rows=skip",
                   "data.cutoff_len=128")
    rows, report = encode(cfg, load_tokenizer(cfg))
    assert len(rows) == 2
    assert dict(report.counts) == {"missing_side": 1, "identical_sides": 1, "empty_answer": 1,
                                   "side_not_assistant": 2, "prompt_too_long": 1, "bad_value": 1,
                                   "missing_conversation": 1}
    strict = make_cfg("objective=dpo", *TRL_FORMAT, f"dataset.paths=[{path}]", "data.cutoff_len=128")
    with pytest.raises(DataError, match=r"pairs.jsonl:2: missing_side"):
        encode(strict, load_tokenizer(strict))


def test_truncation_keeps_the_prompt_tail_and_aligns_both_answers(make_cfg, tmp_path):
    row = {"prompt": [{"role": "user", "content": " ".join(f"w{i}" for i in range(120))}],  # ~300 tokens
           "chosen": [{"role": "assistant", "content": " ".join(["yes"] * 200)}],  # ~600 tokens
           "rejected": [{"role": "assistant", "content": "no"}]}
    path = write_jsonl(tmp_path / "long.jsonl", [row])
    cfg = make_cfg("objective=dpo", *TRL_FORMAT, f"dataset.paths=[{path}]", "data.cutoff_len=512")
    tokenizer = load_tokenizer(cfg)
    wide = make_cfg("objective=dpo", *TRL_FORMAT, f"dataset.paths=[{path}]", "data.cutoff_len=4096")
    (untruncated,), _ = encode(wide, tokenizer)
    (cut,), _ = encode(cfg, tokenizer)
    assert cut["truncated"] and not untruncated["truncated"]
    assert 256 < len(untruncated["prompt_ids"]) < 512 and len(untruncated["chosen_ids"]) > 512
    assert len(cut["prompt_ids"]) == 256  # max(cutoff - longer answer, cutoff // 2)
    assert cut["prompt_ids"] == untruncated["prompt_ids"][-256:]  # the tail: the end of the question stays
    for side in ("chosen", "rejected"):  # both sides share the prompt and fit; answers keep their head
        assert len(cut["prompt_ids"]) + len(cut[f"{side}_ids"]) <= 512
        assert cut[f"{side}_ids"] == untruncated[f"{side}_ids"][:len(cut[f"{side}_ids"])]
    assert len(cut["chosen_ids"]) == 256 and cut["rejected_ids"] == untruncated["rejected_ids"]


def test_llamafactory_ranking_entries_are_preference_sources_only_for_dpo(make_cfg):
    from dsrecipes.core.paths import SAMPLE_DATA_DIR
    from dsrecipes.data.sources.preference import check_sources

    cfg = make_cfg("objective=dpo", "dataset=sample_pairs")
    (source,) = resolve_sources(cfg.dataset)
    assert source.ranking is True and source.columns.chosen == "chosen"
    check_sources(cfg.objective.rows, [source])
    with pytest.raises(ConfigError, match="objective=dpo"):
        check_sources(make_cfg().objective.rows, [source])
    sft = make_cfg(f"dataset.paths=[{SAMPLE_DATA_DIR / 'train.jsonl'}]")
    from dataclasses import replace

    with pytest.raises(ConfigError, match="not preference data"):
        check_sources(cfg.objective.rows, [replace(resolve_sources(sft.dataset)[0], ranking=False)])
    rows, report = encode(make_cfg("objective=dpo", "dataset=sample_pairs", "dataset.max_samples=40"),
                          load_tokenizer(cfg))
    assert len(rows) == 40 and report.skipped == 0


def test_dpo_config_rules(make_cfg):
    with pytest.raises(ConfigError) as err:
        make_cfg("objective=dpo", "data=iterable", "data.packing=true", "objective.beta=0",
                 "objective.loss=robust", "objective.label_smoothing=0.5", "trainer.max_steps=3")
    text = str(err.value)
    for key in ("objective.reference", "data.packing", "objective.beta", "objective.label_smoothing"):
        assert key in text


def test_inspect_shows_the_prompt_once_and_both_trained_answers(trl_setup):
    from dsrecipes.data.render.inspect import render_row

    _, tokenizer, _, _, rows = trl_setup
    text = render_row({**rows[0], "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.5}, tokenizer, color=False)
    assert text.count("What is 2 + 2?") == 1
    assert "[[2 + 2 = 4.<|im_end|>]]" in text and "[[2 + 2 = 5.<|im_end|>]]" in text
    assert "reference log-prob -1.500" in text and "--- rejected" in text


def _trl_metrics(trainer, policy, rows):
    policy.train()
    batch = trainer.data_collator([{k: r[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in rows])
    trainer._compute_loss(policy, batch, return_outputs=False)
    return {k: v[-1] for k, v in trainer._metrics["train"].items()}


def test_eot_newline_option_is_trl_exact(trl_setup, tmp_path):
    """template.train_eot_newline=true: our rows are TRL's own tokenization of the same pairs (the chatml "\\n" after
    <|im_end|> trained), so TRL's log-probs on its own rows equal ours; the default (newline not trained) differs by
    the log-prob of that newline token (measured here, README)."""
    from dsrecipes.config.load import compose_and_load

    cfg, tokenizer, policy, _, rows = trl_setup
    path = cfg.dataset.paths[0] if cfg.dataset.paths else None
    on = compose_and_load(["objective=dpo", *TRL_FORMAT, f"dataset.paths=[{path}]", "template.train_eot_newline=true"],
                          check_files=False)
    rows_on, _ = encode(on, tokenizer)
    _, _, trainer = trl_numbers(trl_setup, tmp_path, "sigmoid", 0.1, 0.0)
    for ours, theirs in zip(rows_on, trainer.train_dataset):
        for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert ours[key] == theirs[key], key
    theirs = _trl_metrics(trainer, policy, list(trainer.train_dataset))
    exact = _trl_metrics(trainer, policy, rows_on)
    default = _trl_metrics(trainer, policy, rows)
    for key in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        assert exact[key] == pytest.approx(theirs[key], rel=1e-6, abs=1e-7), key
    gap = abs(default["logps/chosen"] - theirs["logps/chosen"])
    print(f"default vs TRL: logps/chosen {gap:.3e}, rewards/chosen "
          f"{abs(default['rewards/chosen'] - theirs['rewards/chosen']):.3e}")
    assert gap > 0  # the default leaves the newline out: not TRL's numbers
