"""objective=grpo (issue 48): GRPO's numbers against TRL 1.16, reproducible sampling, rewards chosen by name, prompt
rows under every strategy, and tiny end-to-end runs (ZeRO-0 and ZeRO-2 on CPU, exact resume, refusals as one
message). The SmolLM2 learning run lives in tests/test_grpo_smollm2.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsrecipes.core.errors import ConfigError, DataError

# ---------------------------------------------------------------------------------------------------------------
# loss and advantages vs TRL


def _tiny_lm(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def _fixed_batch():
    """4 prompts x 3 completions: equal-length prompts, completions of different lengths (masked tails), rewards with
    one zero-spread group."""
    import torch

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 64, (4, 5), generator=g).repeat_interleave(3, dim=0)
    completions = torch.randint(1, 64, (12, 6), generator=g)
    mask = torch.ones(12, 6, dtype=torch.long)
    for i, n in enumerate([6, 4, 2, 6, 5, 3, 1, 6, 6, 2, 4, 5]):
        mask[i, n:] = 0
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 0.0, 2.0, 0.3, -1.0, 0.25, 0.0])
    return prompts, completions, mask, rewards


def _trl_trainer(beta: float, temperature: float, accum: int = 1):
    """A GRPOTrainer with the attributes `_compute_loss` reads, and its defaults (loss_type='dapo', token-level
    importance sampling, epsilon 0.2, one generation batch per optimizer step: steps_per_generation = accum) - built
    without __init__ (that needs a dataset, an optimizer, accelerate)."""
    import contextlib

    import torch
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="/tmp/unused", report_to=[], use_cpu=True, bf16=False,
                      gradient_accumulation_steps=accum)
    assert args.steps_per_generation == accum
    t = GRPOTrainer.__new__(GRPOTrainer)
    acc = SimpleNamespace(num_processes=1, sync_gradients=True, autocast=contextlib.nullcontext, is_main_process=True,
                          gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x)
    t.__dict__.update(
        args=args, loss_type=args.loss_type, beta=beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, current_gradient_accumulation_steps=accum,
        accelerator=acc, temperature=temperature, max_completion_length=6,
        _metrics={"train": __import__("collections").defaultdict(list), "eval": __import__("collections").defaultdict(list)})
    assert args.loss_type == "dapo" and args.scale_rewards == "group"  # TRL 1.16's defaults, matched here
    return t, torch


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.04, 0.7)])
def test_loss_and_advantages_equal_trl(beta, temperature):
    """On a fixed batch of prompts, completions and rewards: TRL's advantages (its `nanstd`, the group formula of
    `_generate_and_score_completions` re-derived: that method also samples and scores) and TRL's own `_compute_loss`
    (its per-token log-probs from its fused LM head at the temperature) equal ours within rel 1e-5."""
    import copy

    from trl.trainer.utils import add_fused_lm_head, nanstd

    from dsrecipes.objectives.grpo import GRPO
    from dsrecipes.objectives.grpo_loss import group_advantages, grpo_loss

    trainer, torch = _trl_trainer(beta, temperature)
    prompts, completions, mask, rewards = _fixed_batch()
    grouped = rewards.view(-1, 3)
    mean = grouped.mean(dim=1).repeat_interleave(3)
    std = nanstd(grouped, dim=1).repeat_interleave(3)
    trl_adv = (rewards - mean) / (std + 1e-4)
    ours_adv, _ = group_advantages(rewards, 3)
    torch.testing.assert_close(ours_adv, trl_adv, rtol=1e-5, atol=1e-7)

    model = _tiny_lm()
    patched = copy.deepcopy(model)
    add_fused_lm_head(patched, temperature=temperature, outputs=("log_probs", "entropy"))
    trainer.model = patched.train()
    ref = torch.randn(12, 6, generator=torch.Generator().manual_seed(3)) * 0.1 - 3.0
    inputs = {"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts), "completion_ids": completions,
              "completion_mask": mask, "advantages": trl_adv, "num_items_in_batch": mask.sum().float(),
              "ref_per_token_logps": ref}
    trl_loss = trainer._compute_loss(patched, inputs)

    ours = GRPO(0, 3, 6, temperature, 0.2, 0.0, 0, ())  # the policy log-probs; the reference is given
    logps, _ = ours.logps(model.train(), prompts, torch.ones_like(prompts), completions, mask)
    loss, kl = grpo_loss(logps, logps.detach(), ref, ours_adv, mask, 0.2, beta)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7)
    if beta:
        assert kl > 0 and abs(float(kl) - trainer._metrics["train"]["kl"][-1]) <= 1e-5 * float(kl)
    loss.backward()  # and the gradient flows into the policy
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_token_normalisation_with_accumulation_equals_trl_and_micro_batches_is_as_documented():
    """grad_accum 2 (one process): TRL normalises every micro-batch by the completion tokens of the whole generation
    batch (N), so its step loss is sum(token losses) / N. objective.loss_average=tokens (the default) does the same:
    the loop's token weight is grad_accum / N (rank/step_tokens.py) and DeepSpeed divides each micro-batch by
    grad_accum. With micro_batches each micro-batch is the mean over its own N_m tokens; the README states the
    relation checked here with TRL's own `_compute_loss`: TRL = sum_m (N_m / N) L_m, ours = mean_m L_m."""
    from dsrecipes.objectives.grpo import GRPO
    from dsrecipes.objectives.grpo_loss import group_advantages, grpo_loss
    from dsrecipes.rank.step_tokens import weigh_steps

    trainer, torch = _trl_trainer(0.0, 1.0, accum=2)
    prompts, completions, mask, rewards = _fixed_batch()
    advantages, _ = group_advantages(rewards, 3)
    model = _tiny_lm()
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    trainer.model = model.train()
    total = mask.sum().float()
    halves = [slice(0, 6), slice(6, 12)]  # two micro-batches of 2 prompts x 3 completions
    trl = sum(trainer._compute_loss(model, {"prompt_ids": prompts[h], "prompt_mask": torch.ones_like(prompts[h]),
                                            "completion_ids": completions[h], "completion_mask": mask[h],
                                            "advantages": advantages[h], "num_items_in_batch": total})
              for h in halves)
    ours = GRPO(0, 3, 6, 1.0, 0.2, 0.0, 0, ())
    weights = [b["token_weight"] for b in weigh_steps([{"n": int(mask[h].sum())} for h in halves], 2, 1,
                                                      lambda b: b["n"])]
    per_mb, weighed, tokens = [], [], []
    for h, weight in zip(halves, weights):
        logps, _ = ours.logps(_tiny_lm(), prompts[h], torch.ones_like(prompts[h]), completions[h], mask[h])
        per_mb.append(grpo_loss(logps, logps.detach(), None, advantages[h], mask[h], 0.2, 0.0)[0])
        weighed.append(grpo_loss(logps, logps.detach(), None, advantages[h], mask[h], 0.2, 0.0, weight=weight)[0])
        tokens.append(mask[h].sum().float())
    assert tokens[0] != tokens[1]  # (26 and 24) equal counts would hide the difference
    torch.testing.assert_close(sum(weighed) / 2, trl, rtol=1e-5, atol=1e-7)  # what a default step minimises
    torch.testing.assert_close(trl, sum(n / total * lm for n, lm in zip(tokens, per_mb)), rtol=1e-5, atol=1e-7)
    step = sum(per_mb) / 2  # what one objective.loss_average=micro_batches step minimises
    assert abs(float(step.detach()) - float(trl.detach())) > 1e-4 * abs(float(trl.detach()))


# ---------------------------------------------------------------------------------------------------------------
# sampling: one seed per completion


def test_completions_depend_on_their_seed_only():
    """The same (prompt, seed) gives the same completion whatever else is in the micro-batch; the seed is a function
    of (trainer.seed, epoch, sample id, completion index)."""
    import torch

    from dsrecipes.objectives.grpo_generate import completion_seed, sample

    model = _tiny_lm()
    p = torch.randint(1, 64, (3, 4), generator=torch.Generator().manual_seed(0))
    seeds = [completion_seed(7, 0, f"f.jsonl:{i}", 0) for i in range(3)]
    ids, mask = sample(model, p, torch.ones_like(p), seeds, 6, 1.0, [0], 0)
    alone, _ = sample(model, p[1:2], torch.ones_like(p[1:2]), seeds[1:2], 6, 1.0, [0], 0)
    assert torch.equal(ids[1, :alone.shape[1]], alone[0]) and mask.shape == ids.shape
    again, _ = sample(model, p, torch.ones_like(p), seeds, 6, 1.0, [0], 0)
    assert torch.equal(ids, again)
    assert completion_seed(7, 0, "a", 0) != completion_seed(7, 1, "a", 0) != completion_seed(7, 0, "a", 1)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), p[1:2]], dim=1)  # left padding changes nothing
    left, _ = sample(model, padded, (padded > 0).long() | torch.tensor([[0, 0, 1, 1, 1, 1]]), seeds[1:2], 6,
                     1.0, [0], 0)
    assert torch.equal(left, alone)
    pairs = [completion_seed(7, 0, f"f.jsonl:{i}", j) for i in range(3) for j in range(2)]
    grouped = sample(model, p, torch.ones_like(p), pairs, 6, 1.0, [0], 0, group=2)  # each prompt read once
    repeated = sample(model, p.repeat_interleave(2, dim=0), torch.ones(6, 4, dtype=torch.long), pairs, 6, 1.0, [0], 0)
    assert all(torch.equal(a, b) for a, b in zip(grouped, repeated))


# ---------------------------------------------------------------------------------------------------------------
# prompt rows under every strategy


def arithmetic(path: Path, n: int, seed: int = 0, *extra: str) -> Path:
    """Single-digit sums as prompt rows with the exact answer as `reference`."""
    import random

    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        lines.append(json.dumps({"conversations": [{"from": "human", "value": f"{a}+{b}="}], "reference": a + b}))
    path.write_text("\n".join([*lines, *extra]) + "\n", encoding="utf-8")
    return path


GRPO = ["objective=grpo", "data.cutoff_len=48", "objective.max_completion_length=6", "objective.num_generations=2",
        "trainer.micro_batch_size=2", "trainer.grad_accum=2"]


def compose(*overrides: str):
    from dsrecipes.config.load import compose_and_load

    return compose_and_load([*GRPO, *overrides])


def loaders(cfg, run_dir: Path, world: int):
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    tok = load_tokenizer(cfg)
    plan = plan_like_launcher(cfg, run_dir, world)
    return plan, [build_loaders(cfg, tok, r, world, run_dir, plan)[0] for r in range(world)], tok


def epoch_ids(los, epoch: int):
    out = {}
    for r, lo in enumerate(los):
        lo.set_epoch(epoch)
        out[r] = []
        for batch in lo:
            assert batch["prompt_ids"].shape[0] == len(batch["references"])
            out[r].append(list(batch["ids"]))
    return out


@pytest.mark.parametrize("kind", ["map", "iterable", "presharded"])
def test_prompts_once_per_epoch_equal_steps_and_resume(kind, tmp_path):
    """Each prompt once per epoch over 2 ranks, equal micro-batches, every row's reference carried; a loader stopped
    after 2 micro-batches resumes exactly (and, for a stream, elastically at world 1)."""
    data = arithmetic(tmp_path / "p.jsonl", 36)
    common = [f"dataset.paths=[{data}]", "dataset.val_size=4", f"data.cache_dir={tmp_path}/c"]
    if kind == "presharded":
        from dsrecipes.data.shard.build import shard
        from dsrecipes.data.shard.rows import PROMPT_ROW_FORMAT

        manifest = shard(compose(*common), 2, str(tmp_path / "parts"), val_size=4)
        assert manifest.row_format == PROMPT_ROW_FORMAT
        first = json.loads((tmp_path / "parts" / manifest.files[0]).read_text().splitlines()[0])
        assert first["reference"].isdigit() and first["conversations"][-1]["from"] == "user"
        from dsrecipes.core.tokenizer import load_tokenizer
        from dsrecipes.data.shard.manifest import checked_alike

        # A run whose prompt budget (cutoff_len - max_completion_length = 42 here) is smaller than the shard's
        # would meet prompt_too_long mid-run in a loader worker: its parts are scanned again first.
        assert manifest.checked_with["prompt_budget"] == 42
        alike = lambda *o: checked_alike(manifest.checked_with, compose(*common, *o), load_tokenizer(compose()))  # noqa: E731
        assert alike() and alike("data.cutoff_len=64")
        assert not alike("objective.max_completion_length=7") and not alike("data.cutoff_len=47")
        older = {k: v for k, v in manifest.checked_with.items() if k != "prompt_budget"}  # shard of earlier code
        assert not checked_alike(older, compose(*common), load_tokenizer(compose()))
        common = [f"data.shard_dir={tmp_path / 'parts'}", f"data.cache_dir={tmp_path}/c"]
    cfg = compose(f"data={kind}", *common)
    plan, los, tok = loaders(cfg, tmp_path / "run", 2)
    full = epoch_ids(los, 0)
    got = [i for v in full.values() for b in v for i in b]
    assert len(got) == len(set(got)) == 32 and len({len(v) for v in full.values()}) == 1
    from dsrecipes.data.strategies import build_loaders

    los[0].set_epoch(1)
    los[0].set_epoch(0)
    it = iter(los[0])
    first = [i for _ in range(2) for i in next(it)["ids"]]
    again, _ = build_loaders(cfg, tok, 0, 2, tmp_path / "run", plan)
    again.load_state_dict(los[0].state_dict())
    assert [b["ids"] for b in again] == full[0][2:] and first == [i for b in full[0][:2] for i in b]
    if kind == "iterable":  # elastic: both ranks stop after 2 micro-batches, one rank finishes the epoch
        consumed, states = [], []
        for lo in los:
            lo.set_epoch(1)
            lo.set_epoch(0)
            it = iter(lo)
            consumed += [i for _ in range(2) for i in next(it)["ids"]]
            states.append(lo.state_dict())
        one, _ = build_loaders(compose(f"data={kind}", *common, "trainer.grad_accum=4"), tok, 0, 1, tmp_path / "run",
                               plan)
        one.load_state_dict(states[0])
        done = consumed + [i for b in one for i in b["ids"]]
        assert len(done) == len(set(done)) == 32 and set(done) == set(got)


def test_bad_prompt_rows_named_by_file_line_or_counted(tmp_path):
    """A row ending with an assistant turn, a reference that is not text, a prompt over the budget: under
    bad_rows=error the first is one DataError naming file:line; under skip they are counted by reason."""
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.prompt_encode import read_and_encode_prompts
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.registry import resolve_sources

    long = json.dumps({"conversations": [{"from": "human", "value": "9 " * 200}]})
    ends = json.dumps({"conversations": [{"from": "human", "value": "1+1="}, {"from": "gpt", "value": "2"}]})
    odd = json.dumps({"conversations": [{"from": "human", "value": "1+1="}], "reference": [2]})
    for extra, message in (([long], r"p\.jsonl:6: prompt_too_long \(the prompt has \d+ tokens; data.cutoff_len"),
                           ([ends], r"p\.jsonl:6: bad_value \(the prompt's last turn is the model's \(assistant\)")):
        data = arithmetic(tmp_path / "p.jsonl", 5, 0, *extra)
        cfg = compose(f"dataset.paths=[{data}]")
        tok = load_tokenizer(cfg)
        with pytest.raises(DataError, match=message):
            read_and_encode_prompts(cfg, tok, resolve_sources(cfg.dataset), BadRowReport(cfg.dataset.bad_rows, 1.0))
    data = arithmetic(tmp_path / "p.jsonl", 5, 0, long, ends, odd)
    skip = compose(f"dataset.paths=[{data}]", "dataset.bad_rows=skip")
    report = BadRowReport(skip.dataset.bad_rows, 1.0)
    rows, _ = read_and_encode_prompts(skip, tok, resolve_sources(skip.dataset), report)
    assert len(rows) == 5 and dict(report.counts) == {"prompt_too_long": 1, "bad_value": 2}
    assert all(r["reference"] for r in rows)


# ---------------------------------------------------------------------------------------------------------------
# rewards by name


def test_builtin_rewards():
    from dsrecipes.core.schema import RewardConfig
    from dsrecipes.objectives.rewards import check_of

    assert check_of(RewardConfig("exact_match"))("  Twelve ", "twelve") == 1.0
    assert check_of(RewardConfig("exact_match"))("12", "") == 0.0  # no reference: nothing to match
    assert check_of(RewardConfig("number_equal"))("so 3 + 4 = 7.0", "7") == 1.0
    assert check_of(RewardConfig("number_equal"))("8", "7") == 0.0
    assert check_of(RewardConfig("regex", pattern=r"^\d+$"))("42", "") == 1.0
    assert check_of(RewardConfig("length", min_chars=2, max_chars=3))("abcd", "") == 0.0


def test_installed_reward_functions_only(tmp_path, monkeypatch):
    """A reward named in the recipe runs only when an installed distribution registers it under `dsrecipes.rewards`
    (a dist-info on sys.path made here); an unknown name is refused at validation with the installed names."""
    pkg = tmp_path / "site"
    (pkg / "sevens").mkdir(parents=True)
    (pkg / "sevens" / "__init__.py").write_text("def score(completion, reference):\n    return float('7' in completion)\n")
    info = pkg / "sevens-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sevens\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dsrecipes.rewards]\nsevens = sevens:score\n")
    with pytest.raises(ConfigError, match=r"objective.rewards\[0\].name: 'sevens' is neither a built-in reward"):
        compose("objective.rewards=[{name: sevens}]")
    monkeypatch.syspath_prepend(str(pkg))
    cfg = compose("objective.rewards=[{name: sevens, weight: 2}, {name: exact_match}]")
    from dsrecipes.objectives.rewards import Rewards

    rewards = Rewards(cfg)
    assert rewards.parts(["p", "p"], ["77", "8"], ["8", "8"]) == {"sevens": [1.0, 0.0], "exact_match": [0.0, 1.0]}
    assert rewards.weights == {"sevens": 2.0, "exact_match": 1.0}
    with pytest.raises(ConfigError) as got:
        compose("objective.rewards=[{name: nothere}, {name: regex, pattern: '('}]", "objective.num_generations=1")
    text = str(got.value)
    assert "installed: ['sevens']" in text and "objective.rewards[1].pattern" in text
    assert "objective.num_generations: must be >= 2" in text


# ---------------------------------------------------------------------------------------------------------------
# tiny end-to-end runs (`python -m dsrecipes` in this process, tiny model)

RUN = [*GRPO, "trainer.log_every=1", "scheduler=constant", "scheduler.warmup_steps=0", "optimizer.lr=3e-3",
       "dataset.val_size=4", "trainer.eval_every=4", "trainer.save_every=2", "trainer.export=false",
       "objective.rewards=[{name: exact_match}, {name: length, max_chars: 4, weight: 0.5}]"]


def run(ws: Path, name: str, *overrides: str) -> int:
    from dsrecipes.cli import main
    from tests.conftest import in_process_environ

    run_dir = ws / name
    with in_process_environ():
        return main([*RUN, f"dataset.paths=[{ws / 'p.jsonl'}]", f"data.cache_dir={ws / 'cache'}",
                     f"trainer.output_dir={run_dir}", f"hydra.run.dir={run_dir}", *overrides])


def metrics(run_dir: Path):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 4 steps. B: 2 steps, then the same command to 4 steps (resumes from its step-2 checkpoint). C: ZeRO-2 with
    LoRA and the KL term, 2 steps."""
    ws = tmp_path_factory.mktemp("grpo")
    arithmetic(ws / "p.jsonl", 40)
    assert run(ws, "a", "trainer.max_steps=4", "trainer.prompt_eval_every=4", "trainer.prompt_eval_samples=4") == 0
    assert run(ws, "b", "trainer.max_steps=2") == 0
    assert run(ws, "b", "trainer.max_steps=4") == 0
    assert run(ws, "c", "trainer.max_steps=2", "zero=stage2", "model.lora.enabled=true", "model.lora.dropout=0",
               "objective.beta=0.04", "optimizer.lr=5e-2", "objective.rewards=[{name: regex, pattern: '[aeiou]'}]",
               "objective.num_generations=4") == 0
    return ws


def test_run_reports_what_a_person_acts_on(runs):
    a = metrics(runs / "a")
    assert sorted(a) == [1, 2, 3, 4]
    for key in ("reward", "reward_std", "zero_std_groups", "completion_length", "kl", "gen_tokens_per_s",
                "reward_exact_match", "reward_length"):
        assert all(key in a[s] for s in a), key
    assert all(0 < a[s]["completion_length"] <= 6 and a[s]["gen_tokens_per_s"] > 0 for s in a)
    assert all(abs(a[s]["reward"] - a[s]["reward_exact_match"] - 0.5 * a[s]["reward_length"]) < 1e-6 for s in a)
    evals = [r for r in map(json.loads, (runs / "a" / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert evals and "eval_reward" in evals[-1] and evals[-1]["eval_loss"] == -evals[-1]["eval_reward"]
    assert any("prompt_exact_match" in r for r in map(json.loads, (runs / "a" / "metrics.jsonl").read_text()
                                                       .splitlines()))  # greedy, on held-out prompts' references
    shown = [json.loads(x) for x in (runs / "a" / "grpo_samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in shown} == {1, 2, 3, 4}
    assert set(shown[0]) >= {"id", "prompt", "completion", "reference", "reward", "advantage", "parts"}


def test_resume_samples_and_trains_exactly_as_the_uninterrupted_run(runs):
    """The resumed run's steps 3-4 sample the same completions (seeds from trainer.seed, epoch, sample id) and give
    the same rewards and losses as run A's."""
    a, b = metrics(runs / "a"), metrics(runs / "b")
    for step in (3, 4):
        for key in ("loss", "reward", "reward_std", "completion_length", "grad_norm"):
            assert b[step][key] == a[step][key], (step, key)
    sa = [json.loads(x) for x in (runs / "a" / "grpo_samples.jsonl").read_text().splitlines()]
    sb = [json.loads(x) for x in (runs / "b" / "grpo_samples.jsonl").read_text().splitlines()]
    assert [s for s in sa if s["step"] > 2] == [s for s in sb if s["step"] > 2]


def test_zero2_lora_with_kl_to_the_adapter_free_base(runs):
    """ZeRO-2 with LoRA samples ZeRO-0's completions at step 1 (same weights, same seeds); the KL to the LoRA base
    is 0 before the first update and positive after it."""
    c = metrics(runs / "c")
    assert c[1]["zero_std_groups"] < 1
    shown = {name: [json.loads(x) for x in (runs / name / "grpo_samples.jsonl").read_text().splitlines()]
             for name in ("a", "c")}  # per step: the first two prompts' completions, in completion order
    first = [(s["id"], s["completion"]) for s in shown["a"] if s["step"] == 1][:2]
    assert first == [(s["id"], s["completion"]) for s in shown["c"] if s["step"] == 1][:2]
    assert c[1]["kl"] == 0.0 and c[2]["kl"] > 0


def test_refusals_are_one_message(tmp_path, capsys):
    """A reward model directory that is not one (refused before launch), one whose weights do not load (refused on
    the rank, when the rewards are built), a prompt over the budget: exit 2, one message each, nothing trained."""
    from transformers import LlamaConfig

    arithmetic(tmp_path / "p.jsonl", 12, 0, json.dumps({"conversations": [{"from": "human", "value": "9 " * 60}]}))
    (tmp_path / "rm").mkdir()
    assert run(tmp_path, "r1", f"objective.reward_model={tmp_path / 'rm'}") == 2
    assert run(tmp_path, "r2", "trainer.max_steps=1") == 2
    err = capsys.readouterr().err
    assert "error: objective.reward_model:" in err and "has no config.json" in err
    assert "p.jsonl:13: prompt_too_long" in err and "Traceback" not in err
    assert not (tmp_path / "r2" / "metrics.jsonl").exists()
    arithmetic(tmp_path / "p.jsonl", 12)
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, num_labels=1,  # a scalar head: passes the label check (81456df)
                architectures=["LlamaForSequenceClassification"]).save_pretrained(tmp_path / "rm")
    (tmp_path / "rm" / "model.safetensors").write_bytes(b"not safetensors")  # passes the checks before launch
    assert run(tmp_path, "r3", f"objective.reward_model={tmp_path / 'rm'}", "trainer.max_steps=1") == 2
    captured = capsys.readouterr()
    lines = [x for x in (captured.out + captured.err).splitlines() if "does not load" in x]
    assert len(lines) == 1 and "objective.reward_model:" in lines[0], captured.err[-2000:]
    assert "Traceback" not in captured.out + captured.err and not (tmp_path / "r3" / "metrics.jsonl").exists()


STOPPER = '''import os, signal
calls = [0]
def score(completion, reference):
    """length <= 4 characters (the `length` reward of RUN); on call DSRECIPES_TEST_STOP_AT, SIGTERM to this process."""
    calls[0] += 1
    if str(calls[0]) == os.environ.get("DSRECIPES_TEST_STOP_AT"):
        os.kill(os.getpid(), signal.SIGTERM)
    return float(len(completion) <= 4)
'''


def test_sigterm_mid_rollout_checkpoints_and_resumes_exactly(runs, tmp_path, monkeypatch):
    """SIGTERM lands inside step 3's rollout (in a reward function, after its completions were sampled, before the
    loss): the run stops at a step boundary, checkpoints and exits 143; the same command resumes and every step's loss,
    reward and grad norm equal the uninterrupted run A's (the installed `stopper` reward scores as RUN's `length`)."""
    pkg = tmp_path / "site"
    (pkg / "stopper").mkdir(parents=True)
    (pkg / "stopper" / "__init__.py").write_text(STOPPER)
    (pkg / "stopper-0.1.dist-info").mkdir()
    (pkg / "stopper-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: stopper\nVersion: 0.1\n")
    (pkg / "stopper-0.1.dist-info" / "entry_points.txt").write_text("[dsrecipes.rewards]\nstopper = stopper:score\n")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("DSRECIPES_TEST_STOP_AT", str(2 * 8 + 1))  # 8 completions a step: the first call of step 3
    ws = runs
    args = ["trainer.max_steps=4", "objective.rewards=[{name: exact_match}, {name: stopper, max_chars: 4, weight: 0.5}]"]
    assert run(ws, "s", *args) == 143
    assert sorted(metrics(ws / "s")) in ([1, 2], [1, 2, 3])  # stopped at a step boundary, checkpointed
    monkeypatch.delenv("DSRECIPES_TEST_STOP_AT")
    assert run(ws, "s", *args) == 0
    a, s = metrics(ws / "a"), metrics(ws / "s")
    for step in (1, 2, 3, 4):
        assert [s[step][k] for k in ("loss", "reward", "grad_norm")] == [a[step][k] for k in ("loss", "reward", "grad_norm")]


def test_zero3_gathers_parameters_for_sampling(runs):
    """ZeRO-3 (a subprocess: its partitioning hooks are process-wide): the parameters are partitioned, gathered for
    sampling, and step 1 samples run A's completions."""
    import subprocess

    from tests.conftest import subprocess_env

    ws = runs
    argv = [sys.executable, "-m", "dsrecipes", *RUN, f"dataset.paths=[{ws / 'p.jsonl'}]", f"data.cache_dir={ws / 'cache'}",
            f"trainer.output_dir={ws / 'z3'}", f"hydra.run.dir={ws / 'z3'}", "zero=stage3", "trainer.max_steps=1",
            "trainer.eval_every=0"]
    proc = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "ZeRO-3" in proc.stdout + proc.stderr
    shown = {name: [(s["id"], s["completion"]) for s in map(json.loads, (ws / name / "grpo_samples.jsonl").read_text()
                                                            .splitlines()) if s["step"] == 1] for name in ("a", "z3")}
    assert shown["z3"] and shown["z3"] == shown["a"]


def test_reward_model_directory(tmp_path):
    """A sequence-classification export (config, safetensors, tokenizer beside) scores prompt + completion as the
    part `reward_model`; a directory that names its own code is refused at validation, naming the key."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR
    from dsrecipes.objectives.rewards import Rewards

    tok = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=1, num_attention_heads=4,
                                                       num_key_value_heads=2, num_labels=1))
    out = tmp_path / "rm"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    cfg = compose(f"objective.reward_model={out}", "objective.reward_model_weight=0.5")
    rewards = Rewards(cfg)
    parts = rewards.parts(["1+1=", "1+1="], ["2", "3"], ["2", "2"])
    assert set(parts) == {"exact_match", "reward_model"} and rewards.weights["reward_model"] == 0.5
    assert len(parts["reward_model"]) == 2 and parts["reward_model"][0] != parts["reward_model"][1]
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(ConfigError, match=r"objective.reward_model: .* needs its own Python code"):
        compose(f"objective.reward_model={out}")


def test_inspect_data_shows_prompt_rows(tmp_path, capsys):
    """`dsrecipes inspect-data objective=grpo`: each prepared prompt with its reference, the per-source summary."""
    from dsrecipes.cli import main
    from tests.conftest import in_process_environ

    data = arithmetic(tmp_path / "p.jsonl", 6)
    with in_process_environ():
        code = main(["inspect-data", *GRPO, f"dataset.paths=[{data}]", "dataset.val_size=0",
                     f"data.cache_dir={tmp_path}/c", "--rows", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "=== train row 0: prompt p.jsonl:" in out.out and ", reference " in out.out
    assert "data: per source:" in out.err and "(6 train)" in out.err


@pytest.mark.slow
def test_two_ranks_consume_each_prompt_once_per_epoch(tmp_path):
    """Two real ranks (`launcher=deepspeed launcher.num_gpus=2`, gloo, tiny model), streamed prompts: 8 prompts are
    one global batch (2 ranks x 2 prompts x grad_accum 2), so 2 steps are 2 epochs. The run finishes, both ranks
    ran the same steps, and the ledgers show every prompt exactly once in each epoch across the ranks."""
    from dsrecipes.data.plan.ledger import verify_ledgers
    from tests.test_train_runs import train_run

    arithmetic(tmp_path / "p.jsonl", 8)
    run_dir, out = train_run(tmp_path, "run", *RUN, f"dataset.paths=[{tmp_path / 'p.jsonl'}]", "data=iterable",
                             "dataset.val_size=0", "trainer.eval_every=0", "trainer.save_every=0",
                             "trainer.max_steps=2", "trainer.record_samples=true")
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 2, out[-3000:]
    ids = {f"p.jsonl:{i}" for i in range(1, 9)}
    report = verify_ledgers(run_dir, expected_ids=ids, global_batch=8, complete_epochs=[0, 1])
    assert report.ok, report.summary()
    assert report.epochs == [0, 1] and report.missing == {0: 0, 1: 0}
    assert report.steps_per_rank == {0: 2, 1: 2} and report.samples_per_rank == {0: 8, 1: 8}
    assert sorted(metrics(run_dir)) == [1, 2]
