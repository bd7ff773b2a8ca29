"""The evaluation pass: every rank scores its share of the validation rows once, and the ranks add up sums.

An evaluation is a property of the weights, not of the world size: the validation set (capped by
`trainer.eval_samples`, the first N samples in the split's fixed order, before they are dealt to ranks) is dealt to
the ranks so that each sample is scored exactly once, and what is reduced over ranks are sums (loss sum, predicted
tokens, correctly predicted tokens), never per-rank means. Ranks with fewer micro-batches than the others run
zero-weight forward passes (one ignored token) until every rank has run the same number: ZeRO-3 forwards gather
parameters collectively, so a rank that stopped early would hang the others (and one that stopped them early would
drop samples).

The per-micro-batch math is the objective's (`objective.eval_sums`: SFT's loss sum, predicted and correctly predicted
tokens; DPO's per-pair sums), and so are the numbers made of the reduced sums (`objective.metrics`; SFT's through
objectives/sft.py `EvalResult`: `eval_loss` (token-weighted mean cross-entropy), `eval_ppl` (exp of it), `eval_accuracy` (share of
predicted tokens whose argmax is the label) and `eval_tokens`).

With `trainer.record_samples`, each rank appends the sample ids it scored to `<run>/ledger/eval_rank<R>.jsonl`
(`{"step": s, "ids": [...]}` per evaluation); `verify_eval_ledgers` proves every evaluation scored the same samples,
each once across ranks.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

import dsrecipes.core.stall as stall
from dsrecipes.core.distributed import all_reduce
from dsrecipes.core.fileio import open_append
from dsrecipes.data.plan.ledger import LEDGER_DIR

EVAL_LEDGER_PREFIX = "eval_rank"  # <run>/ledger/eval_rank<R>.jsonl (the training ledger's files are rank<R>.jsonl)


@torch.no_grad()
def evaluate(objective: Any, engine: Any, loader: Any, ledger: Optional["EvalLedger"] = None,
             step: int = 0) -> Dict[str, float]:
    """Collective: score this rank's share of the validation rows with the objective's per-micro-batch sums
    (`objective.eval_sums`), pad with zero-weight micro-batches (`objective.collate([])`: counts nothing) up to the
    largest share's number of micro-batches, add up the sums of every rank, and turn them into the objective's
    `eval_*` numbers (the same on every rank)."""
    engine.eval()
    passes = int(all_reduce(torch.tensor([len(loader)], dtype=torch.int64), "MAX")[0])
    keys = objective.eval_keys
    sums = torch.zeros(len(keys), dtype=torch.float64)
    scored: List[str] = []
    batches = iter(loader)
    for _ in range(passes):
        batch = next(batches, None)
        if batch is None:
            batch = objective.collate([])
        got = objective.eval_sums(engine, batch, engine.device)
        sums += torch.tensor([float(got[k]) for k in keys], dtype=torch.float64)
        scored.extend(batch["ids"])
        stall.mark("eval")  # a long evaluation is progress, not a stall (the watchdog, core/stall.py): no I/O
    if next(batches, None) is not None:
        raise RuntimeError("evaluation loader yielded more micro-batches than its len()")
    if ledger is not None:
        ledger.record(step, scored)
    all_reduce(sums, "SUM")
    engine.train()
    return objective.metrics(dict(zip(keys, sums.tolist())), "eval_")


# ---------------------------------------------------------------------------------------------------------------
# Evaluation ledger


class EvalLedger:
    """This rank's `<run>/ledger/eval_rank<R>.jsonl`: the sample ids it scored in each evaluation."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.path = Path(run_dir) / LEDGER_DIR / f"{EVAL_LEDGER_PREFIX}{rank}.jsonl"
        self._fh = open_append(self.path, buffering=1)
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
