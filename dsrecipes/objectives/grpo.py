"""`objective=grpo`: Group Relative Policy Optimization (online RL) on prompt rows (`rows=prompt`).

For each micro-batch, on each rank, for each of its prompts (`collate`: left-padded prompt ids, the reference
answers, the sample ids); with objective.loss_average=tokens (the default) steps 1-2 run for all of an optimizer
step's micro-batches before its first backward (`tokens`, rank/step_tokens.py), as TRL's generation batch:
1. `objective.num_generations` completions are sampled by the policy (grpo_generate.py: one seed per completion
   from (trainer.seed, epoch, the prompt's position, completion index: `seed_keys`), so resume and elastic resume
   sample exactly the same;
   ZeRO-3 parameters gathered for the sampling, and every rank runs the same number of forwards);
2. rewards: the configured parts (objectives/rewards.py: built-in checks, installed functions, a reward model:
   under ZeRO-3 partitioned in its own DeepSpeed engine, scored once per micro-batch on every rank alike), summed
   with their weights;
3. group-normalised advantages and the clipped policy loss with an optional KL to the reference (grpo_loss.py:
   TRL's numbers); the reference is the LoRA base with the adapters disabled (no second copy; objective.beta > 0
   needs LoRA).
Train metrics (sums over completions, reported as means): reward and each part (`reward_<part>`), `reward_std`
(within-group spread), `zero_std_groups` (share of groups whose completions all got the same reward: no
learning signal), `completion_length`, `kl`, `gen_tokens_per_s` (generated tokens / sampling seconds, per rank).
A micro-batch with no prompt on a rank (the end of an epoch) runs the rollout of a placeholder prompt with weight
0, so every rank runs the same collectives. Every `trainer.log_every` steps rank 0 appends a few completions with their rewards to `<run>/grpo_samples.jsonl`.
Evaluation samples with seeds of epoch -1 and reports `eval_reward`; `eval_loss` is minus the mean reward (lower is
better, like every objective's selection metric).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from dsrecipes.core.schema import LossAverage, ObjectiveKind, RowKind, TrainConfig
from dsrecipes.objectives.base import Batch, Row, pad_token_id, ratio
from dsrecipes.objectives.grpo_generate import completion_seed, gathered, sample, stop_ids
from dsrecipes.objectives.grpo_loss import group_advantages, grpo_loss, token_logps
from dsrecipes.objectives.rewards import Rewards, part_names

SUMS = ("completions", "groups", "reward", "reward_std", "zero_std_groups", "completion_tokens", "kl",
        "gen_tokens", "gen_seconds")
SAMPLES_FILE = "grpo_samples.jsonl"


@dataclass
class GRPO:
    pad_id: int
    num_generations: int
    max_completion_length: int
    temperature: float
    epsilon: float
    beta: float
    seed: int
    parts: Tuple[str, ...]
    log_every: int = 10
    kind: ObjectiveKind = ObjectiveKind.grpo
    step_tokens: bool = True  # objective.loss_average=tokens: `tokens` samples before the step's first backward
    row_kind: RowKind = RowKind.prompt
    train_keys: Tuple[str, ...] = SUMS
    eval_keys: Tuple[str, ...] = SUMS
    run_dir: Optional[str] = None
    tokenizer: Any = field(default=None, repr=False)  # set by attach (on the rank; collate never needs it)
    rewards: Any = field(default=None, repr=False)
    engine: Any = field(default=None, repr=False)
    stops: List[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.train_keys = self.eval_keys = SUMS + tuple(f"reward_{p}" for p in self.parts)

    def collate(self, rows: List[Row]) -> Batch:
        real = bool(rows)
        rows = rows or [{"ids": [], "prompt_ids": [self.pad_id], "reference": ""}]
        width = max(len(r["prompt_ids"]) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left-padded: every prompt ends where the completions start
            n = len(r["prompt_ids"])
            ids[i, width - n:] = torch.as_tensor(list(r["prompt_ids"]), dtype=torch.long)
            mask[i, width - n:] = 1
        return {"prompt_ids": ids, "prompt_mask": mask, "references": [str(r["reference"]) for r in rows],
                "sample_ids": [r["ids"][0] if r["ids"] else "" for r in rows], "real": real,
                "ids": [i for r in rows for i in r["ids"]], "num_tokens": int(mask.sum()) if real else 0}

    def attach(self, cfg: TrainConfig, tokenizer: Any, engine: Any) -> None:
        self.tokenizer, self.engine = tokenizer, engine
        self.stops = stop_ids(tokenizer)
        zero3 = cfg.zero.stage == 3 and getattr(engine, "config", None) is not None  # the reward model partitioned
        self.rewards = Rewards(cfg, getattr(engine, "device", None), engine.config if zero3 else None)

    def tokens(self, model: Any, batch: Batch, device: torch.device) -> int:
        """Before the step's first backward (rank/step_tokens.py): sample and score the micro-batch's completions
        (kept in the batch for `loss`); the completion tokens its loss counts (none for a placeholder prompt)."""
        batch["rollout"] = self.sample_and_score(model, batch, device, int(batch.get("epoch", 0)))
        return int(batch["rollout"]["mask"].sum()) if batch["real"] else 0

    def loss(self, model: Any, batch: Batch, device: torch.device) -> Tuple[torch.Tensor, Dict[str, Any]]:
        loss, sums, shown = self.rollout(model, batch, device, int(batch.get("epoch", 0)), train=True)
        step = int(getattr(self.engine, "global_steps", 0)) + 1
        if shown and self.log_every and step % self.log_every == 0:
            self.write_samples(step, shown)
        return loss, sums

    def eval_sums(self, model: Any, batch: Batch, device: torch.device) -> Dict[str, float]:
        with torch.no_grad():
            _, sums, _ = self.rollout(model, batch, device, -1, train=False)
        return {k: float(v) for k, v in sums.items()}

    def metrics(self, sums: Dict[str, float], prefix: str) -> Dict[str, float]:
        n, groups = sums["completions"], sums["groups"]
        out = {"eval_loss": -ratio(sums["reward"], n)} if prefix == "eval_" else {}
        out.update({f"{prefix}reward": ratio(sums["reward"], n), f"{prefix}reward_std": ratio(sums["reward_std"], groups),
                    f"{prefix}zero_std_groups": ratio(sums["zero_std_groups"], groups),
                    f"{prefix}completion_length": ratio(sums["completion_tokens"], n),
                    f"{prefix}kl": ratio(sums["kl"], n),
                    f"{prefix}gen_tokens_per_s": ratio(sums["gen_tokens"], sums["gen_seconds"])})
        out.update({f"{prefix}reward_{p}": ratio(sums[f"reward_{p}"], n) for p in self.parts})
        return out

    def sample_and_score(self, model: Any, batch: Batch, device: torch.device, epoch: int) -> Dict[str, Any]:
        """Sample `num_generations` completions per prompt (no gradient) and score them: rewards and advantages."""
        g = self.num_generations
        prompts = batch["prompt_ids"].to(device).repeat_interleave(g, dim=0)
        prompt_mask = batch["prompt_mask"].to(device).repeat_interleave(g, dim=0)
        seeds = [completion_seed(self.seed, epoch, key, j) for key in seed_keys(batch) for j in range(g)]
        started = time.perf_counter()
        completions, mask = self.generate(model, batch["prompt_ids"].to(device), batch["prompt_mask"].to(device), seeds)
        seconds = time.perf_counter() - started
        texts, prompt_texts = self.decode(completions, mask), self.decode(prompts, prompt_mask)
        refs = [r for r in batch["references"] for _ in range(g)]
        parts = self.rewards.parts(prompt_texts, texts, refs)
        rewards = sum(torch.tensor(v, dtype=torch.float32) * self.rewards.weights[k] for k, v in parts.items())
        advantages, std = group_advantages(rewards, g)
        return {"prompts": prompts, "prompt_mask": prompt_mask, "completions": completions, "mask": mask,
                "seconds": seconds, "texts": texts, "prompt_texts": prompt_texts, "refs": refs, "parts": parts,
                "rewards": rewards, "advantages": advantages, "std": std}

    def rollout(self, model: Any, batch: Batch, device: torch.device, epoch: int, train: bool
                ) -> Tuple[torch.Tensor, Dict[str, Any], List[Dict[str, Any]]]:
        """(loss, sums, a few shown completions) of one micro-batch: sample, reward, advantages (sampled already
        where the loop asked for the step's `tokens`), loss. Evaluation without the KL term (objective.beta = 0)
        reports rewards only and skips the log-prob forward (every rank alike)."""
        g = self.num_generations
        r = batch.pop("rollout", None) if train else None
        r = r if r is not None else self.sample_and_score(model, batch, device, epoch)
        prompts, prompt_mask, completions, mask = r["prompts"], r["prompt_mask"], r["completions"], r["mask"]
        texts, prompt_texts, refs, parts = r["texts"], r["prompt_texts"], r["refs"], r["parts"]
        rewards, advantages, std, seconds = r["rewards"], r["advantages"], r["std"], r["seconds"]
        if train or self.beta != 0.0:
            logps, ref = self.logps(model, prompts, prompt_mask, completions, mask)
            loss, kl = grpo_loss(logps, logps.detach(), ref, advantages.to(device), mask, self.epsilon, self.beta,
                                 weight=batch.get("token_weight") if train else None)
        else:
            loss = kl = torch.zeros((), device=device)
        groups = rewards.view(-1, g)
        lengths = mask.sum(dim=1).float().cpu()
        sums: Dict[str, Any] = {
            "completions": torch.tensor(float(len(texts))), "groups": torch.tensor(float(groups.shape[0])),
            "reward": rewards.sum(), "reward_std": std.view(-1, g)[:, 0].sum(),
            "zero_std_groups": torch.isclose(std.view(-1, g)[:, 0], torch.zeros(1)).float().sum(),
            "completion_tokens": lengths.sum(), "kl": kl.detach().cpu() * len(texts),
            "gen_tokens": lengths.sum(), "gen_seconds": torch.tensor(seconds)}
        sums.update({f"reward_{k}": torch.tensor(v).sum() for k, v in parts.items()})
        if not batch["real"]:  # a rank without a prompt here ran the placeholder's rollout like the others (ZeRO-3:
            return loss * 0.0, {k: torch.zeros(()) for k in sums}, []  # the same collectives); it trains nothing
        shown = [{"id": batch["sample_ids"][i // g], "prompt": prompt_texts[i], "completion": texts[i],
                  "reference": refs[i], "reward": float(rewards[i]), "advantage": float(advantages[i]),
                  "parts": {k: v[i] for k, v in parts.items()}} for i in range(min(len(texts), 2 * g))]
        return loss, sums, shown

    def generate(self, model: Any, prompts: torch.Tensor, prompt_mask: torch.Tensor, seeds: List[int]
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        module = getattr(model, "module", model)
        was_training = module.training
        module.eval()
        try:
            with gathered(module) as partitioned:  # ZeRO-3: every rank runs max_completion_length forwards
                return sample(module, prompts, prompt_mask, seeds, self.max_completion_length, self.temperature,
                              self.stops, self.pad_id, stop_early=not partitioned, group=self.num_generations)
        finally:
            module.train(was_training)

    def logps(self, model: Any, prompts: torch.Tensor, prompt_mask: torch.Tensor, completions: torch.Tensor,
              mask: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(policy log-probs of the completion tokens, the reference's when objective.beta > 0)."""
        ids = torch.cat([prompts, completions], dim=1)
        attn = torch.cat([prompt_mask, mask], dim=1)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        width = completions.shape[1]

        def forward(m: Any) -> torch.Tensor:  # the LM head on the completion positions only (TRL: logits_to_keep)
            logits = m(input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=width + 1).logits
            return token_logps(logits[:, :-1, :], completions, self.temperature)

        logps = forward(model)
        if self.beta == 0.0:
            return logps, None
        module = getattr(model, "module", model)
        with torch.no_grad(), module.disable_adapter():  # the LoRA base: no second copy (validation requires LoRA)
            return logps, forward(module)

    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> List[str]:
        return [self.tokenizer.decode([int(t) for t, m in zip(row, keep) if m], skip_special_tokens=True)
                for row, keep in zip(ids.tolist(), mask.tolist())]

    def write_samples(self, step: int, shown: List[Dict[str, Any]]) -> None:
        """Rank 0: the step's first completions with their rewards, appended to `<run>/grpo_samples.jsonl`."""
        if self.run_dir is None or torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        with open(Path(self.run_dir) / SAMPLES_FILE, "a", encoding="utf-8") as f:
            for row in shown:
                f.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")


def build(cfg: TrainConfig, tokenizer: Any) -> GRPO:
    o = cfg.objective
    return GRPO(pad_token_id(tokenizer), o.num_generations, o.max_completion_length, o.temperature, o.epsilon,
                o.beta, cfg.trainer.seed, tuple(part_names(cfg)), log_every=cfg.trainer.log_every,
                run_dir=cfg.trainer.output_dir, step_tokens=cfg.objective.loss_average is LossAverage.tokens)


def seed_keys(batch: Batch) -> List[str]:
    """What each prompt's completion seeds are drawn from: its position (`keys`: map `row<N>`, iterable `file:line`,
    presharded `part:line`, set by the data loader; the ledger's exactly-once check proves them unique in an epoch),
    the sample id only where the batch has none (the placeholder prompt of an empty micro-batch). A sample id is no
    position: a row without an `id` is `basename:line`, so line 1 of a/train.jsonl and b/train.jsonl, two different
    prompts, were sampled with the same seeds."""
    keys = batch.get("keys")
    ids = batch["sample_ids"]
    return [str(k) for k in keys] if keys is not None and len(keys) == len(ids) else list(ids)
