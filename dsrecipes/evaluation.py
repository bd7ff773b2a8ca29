"""The evaluation pass: every rank scores its share of the validation rows once, and the ranks add up sums.

An evaluation is a property of the weights, not of the world size: the validation set (capped by
`trainer.eval_samples`, the first N samples in the split's fixed order, before they are dealt to ranks) is dealt to
the ranks so that each sample is scored exactly once, and what is reduced over ranks are sums (loss sum, predicted
tokens, correctly predicted tokens), never per-rank means. Ranks with fewer micro-batches than the others run
zero-weight forward passes (one ignored token) until every rank has run the same number: ZeRO-3 forwards gather
parameters collectively, so a rank that stopped early would hang the others (and one that stopped them early would
drop samples).

`batch_sums(logits, labels, position_ids)` is the per-micro-batch math (the objective's eval); `EvalResult` turns the
reduced sums into the logged metrics: `eval_loss` (token-weighted mean cross-entropy), `eval_ppl` (exp of it) and
`eval_accuracy` (share of predicted tokens whose argmax is the label).

With `trainer.record_samples`, each rank appends the sample ids it scored to `<run>/ledger/eval_rank<R>.jsonl`
(`{"step": s, "ids": [...]}` per evaluation); `verify_eval_ledgers` proves every evaluation scored the same samples,
each once across ranks.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from dsrecipes.data.labels import IGNORE_INDEX
from dsrecipes.data.ledger import LEDGER_DIR

EVAL_LEDGER_PREFIX = "eval_rank"  # <run>/ledger/eval_rank<R>.jsonl (the training ledger's files are rank<R>.jsonl)


@dataclass(frozen=True)
class EvalResult:
    """Sums over every rank and micro-batch of one evaluation."""

    loss_sum: float
    tokens: int
    correct: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        try:
            return math.exp(self.loss)  # nan stays nan
        except OverflowError:
            return float("inf")

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens if self.tokens else float("nan")

    def metrics(self) -> Dict[str, float]:
        """The logged numbers (metrics.jsonl keys)."""
        return {"eval_loss": self.loss, "eval_ppl": self.perplexity, "eval_accuracy": self.accuracy,
                "eval_tokens": self.tokens}


def batch_sums(logits: torch.Tensor, labels: torch.Tensor,
               position_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed next-token cross-entropy, predicted tokens, correctly predicted tokens) of one micro-batch.

    Token t predicts label t+1; labels -100 do not count, nor does the first token of a packed sample (where
    `position_ids` restarts at 0), exactly as the training loss counts them."""
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).to(logits.device)
    if position_ids is not None:
        starts = torch.nn.functional.pad(position_ids[:, 1:] == 0, (0, 1), value=False).to(logits.device)
        shift = shift.masked_fill(starts, IGNORE_INDEX)
    counted = shift != IGNORE_INDEX
    flat = logits.float().reshape(-1, logits.size(-1))
    loss_sum = torch.nn.functional.cross_entropy(flat, shift.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    correct = ((logits.argmax(dim=-1) == shift) & counted).sum()
    return loss_sum, counted.sum(), correct


def empty_batch() -> Dict[str, Any]:
    """A zero-weight micro-batch (one token, no label): a forward pass that counts nothing."""
    one = torch.zeros((1, 1), dtype=torch.long)
    return {"input_ids": one, "labels": torch.full((1, 1), IGNORE_INDEX, dtype=torch.long), "position_ids": one,
            "attention_mask": torch.ones((1, 1), dtype=torch.long), "ids": []}


def forward_sums(model: Any, batch: Dict[str, Any], device: torch.device) -> torch.Tensor:
    """[loss sum, tokens, correct] (float64, on CPU) of one collated micro-batch."""
    mask = batch["attention_mask"]
    position_ids = batch["position_ids"].to(device)
    out = model(input_ids=batch["input_ids"].to(device), position_ids=position_ids,
                attention_mask=None if mask is None else mask.to(device), use_cache=False)
    loss_sum, tokens, correct = batch_sums(out.logits, batch["labels"].to(device), position_ids)
    return torch.tensor([float(loss_sum), int(tokens), int(correct)], dtype=torch.float64)


def _reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    return tensor


@torch.no_grad()
def evaluate(engine: Any, loader: Any, ledger: Optional["EvalLedger"] = None, step: int = 0) -> EvalResult:
    """Collective: score this rank's share of the validation rows, pad with zero-weight forwards up to the largest
    share's number of micro-batches, and add up the sums of every rank (the same result on every rank)."""
    engine.eval()
    passes = int(_reduce(torch.tensor([len(loader)], dtype=torch.int64), "MAX")[0])
    sums = torch.zeros(3, dtype=torch.float64)
    scored: List[str] = []
    batches = iter(loader)
    for _ in range(passes):
        batch = next(batches, None)
        if batch is None:
            batch = empty_batch()
        sums += forward_sums(engine, batch, engine.device)
        scored.extend(batch["ids"])
    if next(batches, None) is not None:
        raise RuntimeError("evaluation loader yielded more micro-batches than its len()")
    if ledger is not None:
        ledger.record(step, scored)
    _reduce(sums, "SUM")
    engine.train()
    loss_sum, tokens, correct = sums.tolist()
    return EvalResult(loss_sum, int(tokens), int(correct))


# ---------------------------------------------------------------------------------------------------------------
# Evaluation ledger


class EvalLedger:
    """This rank's `<run>/ledger/eval_rank<R>.jsonl`: the sample ids it scored in each evaluation."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.path = Path(run_dir) / LEDGER_DIR / f"{EVAL_LEDGER_PREFIX}{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8", buffering=1)
        self._fh.write(json.dumps({"session": time.time(), "pid": os.getpid()}) + "\n")

    def record(self, step: int, ids: Sequence[str]) -> None:
        self._fh.write(json.dumps({"step": int(step), "ids": list(ids)}, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


def read_eval_ledger(path: Path) -> Dict[int, List[str]]:
    """step -> ids one rank scored; a resumed session's evaluations replace those it repeats."""
    steps: Dict[int, List[str]] = {}
    new_session = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "session" in rec:
            new_session = True
            continue
        if new_session:
            steps = {s: v for s, v in steps.items() if s < rec["step"]}
            new_session = False
        steps[rec["step"]] = list(rec["ids"])
    return steps


def verify_eval_ledgers(run_dir: str | os.PathLike, expected_ids: Optional[Iterable[str]] = None) -> List[str]:
    """Problems with the evaluations a run recorded (empty: every evaluation scored the same samples, each exactly
    once across ranks, and with `expected_ids` exactly those)."""
    files = sorted(Path(run_dir, LEDGER_DIR).glob(f"{EVAL_LEDGER_PREFIX}*.jsonl"))
    if not files:
        return [f"no evaluation ledgers in {Path(run_dir, LEDGER_DIR)} (trainer.record_samples=true?)"]
    by_step: Dict[int, Counter] = defaultdict(Counter)
    for path in files:
        for step, ids in read_eval_ledger(path).items():
            by_step[step].update(ids)
    problems = []
    first = None if expected_ids is None else set(expected_ids)
    for step in sorted(by_step):
        counts = by_step[step]
        twice = sorted(i for i, n in counts.items() if n > 1)
        if twice:
            problems.append(f"evaluation at step {step}: {len(twice)} samples scored more than once, e.g. {twice[:5]}")
        first = set(counts) if first is None else first
        if set(counts) != first:
            problems.append(f"evaluation at step {step}: scored {len(counts)} samples, not the same set as the others "
                            f"({len(set(counts) ^ first)} differ)")
    return problems
