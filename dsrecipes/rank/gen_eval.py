"""Prompt-eval during training (`trainer.prompt_eval_every`): the weights answer held-out prompts greedily, and the
answers are scored like `dsrecipes prompt-eval` scores them (prompt_eval.py: normalised exact match, difflib
similarity, answers that ended at the end-of-turn token).

The prompts are a fixed set: the first `trainer.prompt_eval_samples` validation samples of the prepared split
(`data=map`), each cut at its last trained span: the tokens before it are the prompt (exactly the tokens training
and evaluation see, so the template is the run's own), the span without its end-of-turn token is the reference.
They are dealt to ranks round-robin; every rank calls `generate` the same number of times (a rank out of prompts
answers a one-token dummy prompt, scored nowhere), and under ZeRO-3 `synced_gpus` keeps the ranks' forward passes in
step until the longest answer ends. The ranks add up sums, so the numbers do not depend on the world size:

    prompt_exact_match, prompt_similarity, prompt_ended (shares of the prompts), prompt_count

Greedy decoding draws nothing from the RNG, so a prompt-eval does not change the training that follows.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

import dsrecipes.core.stall as stall
from dsrecipes.core.answers import normalize
from dsrecipes.core.distributed import all_reduce
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.serving import end_of_turn_ids, run_template


@dataclass(frozen=True)
class HeldOutPrompt:
    ids: List[int]  # the prompt: every token before the last trained span
    reference: str  # that span's text, without its end-of-turn token


def samples_of(row: Dict[str, Any]) -> List[Dict[str, List[int]]]:
    """A prepared row split into its samples (a packed row's `position_ids` restart at 0 for each)."""
    ids, labels = list(row["input_ids"]), list(row["labels"])
    pos = list(row.get("position_ids") or range(len(ids)))
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
    return [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip(starts, starts[1:]) if b > a]


def held_out_prompt(sample: Dict[str, List[int]], tokenizer: Any, stop_ids: Sequence[int]) -> Optional[HeldOutPrompt]:
    """The sample cut at its last trained span (None when nothing is trained, or the span opens the sample)."""
    labels = sample["labels"]
    trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    if not trained:
        return None
    end = start = trained[-1] + 1
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    if start == 0:
        return None
    reply = list(sample["input_ids"][start:end])
    while reply and reply[-1] in stop_ids:
        reply.pop()
    return HeldOutPrompt(list(sample["input_ids"][:start]), tokenizer.decode(reply, skip_special_tokens=True).strip())


def held_out_prompts(rows: Any, limit: int, tokenizer: Any, stop_ids: Sequence[int]) -> List[HeldOutPrompt]:
    out: List[HeldOutPrompt] = []
    for row in rows:
        if "reference" in row:  # a prompt row (rows=prompt): its prompt and reference answer as they are
            out += [HeldOutPrompt(list(row["prompt_ids"]), str(row["reference"]))] if row["reference"] else []
            if len(out) >= limit:
                return out
            continue
        for sample in samples_of(row):
            prompt = held_out_prompt(sample, tokenizer, stop_ids)
            if prompt is not None:
                out.append(prompt)
            if len(out) >= limit:
                return out
    return out


class PromptEval:
    """This rank's share of the held-out prompts, and how to score the current weights on them (collective)."""

    def __init__(self, prompts: List[HeldOutPrompt], rank: int, world_size: int, tokenizer: Any,
                 stop_ids: List[int], max_new_tokens: int, synced: bool):
        self.mine = prompts[rank::world_size]
        self.passes = math.ceil(len(prompts) / world_size)
        self.tokenizer, self.stop_ids, self.max_new_tokens, self.synced = tokenizer, stop_ids, max_new_tokens, synced
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]

    @torch.no_grad()
    def run(self, engine: Any) -> Dict[str, float]:
        engine.eval()
        sums = torch.zeros(4, dtype=torch.float64)  # exact, similarity, ended, count
        for k in range(self.passes):
            prompt = self.mine[k] if k < len(self.mine) else None
            new = self._answer(engine.module, prompt.ids if prompt is not None else [self.pad_id], engine.device)
            stall.mark("eval")  # each answer is progress: a long prompt-eval is not a stall (core/stall.py)
            if prompt is None:
                continue
            answer = normalize(self.tokenizer.decode(new, skip_special_tokens=True))
            reference = normalize(prompt.reference)
            sums += torch.tensor([answer == reference, difflib.SequenceMatcher(None, answer, reference).ratio(),
                                  bool(new) and new[-1] in self.stop_ids, 1], dtype=torch.float64)
        all_reduce(sums)
        engine.train()
        exact, similarity, ended, count = sums.tolist()
        n = max(count, 1.0)
        return {"prompt_exact_match": exact / n, "prompt_similarity": similarity / n, "prompt_ended": ended / n,
                "prompt_count": int(count)}

    def _answer(self, module: Any, ids: List[int], device: Any) -> List[int]:
        """Greedy, one beam, the default cache: transformers fills what generate() is not given from the model's
        generation_config, which came from model.path's generation_config.json (a directory's `num_beams`,
        `cache_implementation: quantized` importing optional packages, ...). While it runs, the model's is a clean
        one; the directory's stays for the export."""
        from transformers import GenerationConfig

        prompt = torch.tensor([ids], device=device)
        loaded = module.generation_config
        module.generation_config = GenerationConfig(do_sample=False, num_beams=1, use_cache=True)
        try:
            out = module.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=self.max_new_tokens,
                                  do_sample=False, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                                  use_cache=True, synced_gpus=self.synced)
        finally:
            module.generation_config = loaded
        return out[0, len(ids):].tolist()


def build_prompt_eval(cfg: Any, tokenizer: Any, rank: int, world_size: int, run_dir: Any) -> Optional[PromptEval]:
    """The prompt-eval of a run (None when `trainer.prompt_eval_every` is 0 or there are no held-out prompts)."""
    t = cfg.trainer
    if t.prompt_eval_every <= 0:
        return None
    from dsrecipes.data.prepare.build import load_prepared  # lazy: else `gen_eval` imports numpy 0.11 s

    val = load_prepared(cfg, str(run_dir)).val  # data=map with a validation split (selection.py's config rules)
    if val is None or len(val) == 0:
        return None
    stop_ids = end_of_turn_ids(run_template(cfg, tokenizer), tokenizer)
    prompts = held_out_prompts(val, t.prompt_eval_samples, tokenizer, stop_ids)
    if not prompts:
        return None
    return PromptEval(prompts, rank, world_size, tokenizer, stop_ids, t.prompt_eval_max_new_tokens,
                      synced=cfg.zero.stage == 3 and world_size > 1)
