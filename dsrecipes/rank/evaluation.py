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

With `trainer.record_samples`, each rank appends the sample ids it scored, and the positions the loader dealt them
at (`keys`), to `<run>/ledger/eval_rank<R>.jsonl` (`{"step": s, "ids": [...], "keys": [...]}` per evaluation:
data/plan/eval_ledger.py); `verify_eval_ledgers` (and `dsrecipes audit --ledger`) proves every evaluation scored the
same samples, each once across ranks.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

import dsrecipes.core.stall as stall
from dsrecipes.core.distributed import all_reduce
from dsrecipes.data.plan.eval_ledger import EvalLedger, read_eval_ledger, verify_eval_ledgers

__all__ = ["EvalLedger", "evaluate", "read_eval_ledger", "verify_eval_ledgers"]  # the ledger's names, as before


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
    dealt: Optional[List[str]] = []  # the positions of the scored samples (None: a loader that deals none)
    batches = iter(loader)
    for _ in range(passes):
        batch = next(batches, None)
        if batch is None:
            batch = objective.collate([])
        got = objective.eval_sums(engine, batch, engine.device)
        sums += torch.tensor([float(got[k]) for k in keys], dtype=torch.float64)
        scored.extend(batch["ids"])
        if batch["ids"] and "keys" not in batch:
            dealt = None
        elif dealt is not None:
            dealt.extend(batch.get("keys", ()))  # (a zero-weight pass deals nothing)
        stall.mark("eval")  # a long evaluation is progress, not a stall (the watchdog, core/stall.py): no I/O
    if next(batches, None) is not None:
        raise RuntimeError("evaluation loader yielded more micro-batches than its len()")
    if ledger is not None:
        ledger.record(step, scored, dealt)
    all_reduce(sums, "SUM")
    engine.train()
    return objective.metrics(dict(zip(keys, sums.tolist())), "eval_")
