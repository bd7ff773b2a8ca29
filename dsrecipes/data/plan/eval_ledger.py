"""Evaluation ledger (`trainer.record_samples=true`): which validation samples each rank scored, per evaluation.

Each rank appends `{"step": s, "ids": [...], "keys": [...]}` lines to `<run>/ledger/eval_rank<R>.jsonl` (one line
per evaluation, after a `{"session": ...}` mark per process, as the training ledger does: data/plan/ledger.py). `ids`
are the samples' ids, which need not be unique (two validation files named `valid.jsonl` in different folders, an id
column that repeats); `keys` are the positions the evaluation loader dealt (data/strategies/eval.py: `row<N>`, the
row's place in the validation rows), unique by construction. A ledger written before `keys` is checked by its ids.

`check_eval_ledgers(run_dir)` proves every evaluation scored each sample exactly once across ranks (counting keys;
ids naming several samples are a note) and the same samples as every other evaluation; `dsrecipes audit --ledger`
runs it when the run recorded evaluations.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from dsrecipes.data.plan.ledger import LEDGER_DIR, LedgerFile, Verdict, ledger_records, tally

EVAL_LEDGER_PREFIX = "eval_rank"  # <run>/ledger/eval_rank<R>.jsonl (the training ledger's files are rank<R>.jsonl)


class EvalLedger(LedgerFile):
    """This rank's `<run>/ledger/eval_rank<R>.jsonl`: the samples it scored in each evaluation."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, world_size: Optional[int] = None):
        super().__init__(run_dir, f"{EVAL_LEDGER_PREFIX}{rank}.jsonl", world_size)

    def record(self, step: int, ids: Sequence[str], keys: Optional[Sequence[str]] = None) -> None:
        self.write({"step": int(step)}, ids, keys)


def eval_ledger_files(run_dir: str | os.PathLike) -> List[Path]:
    return sorted(Path(run_dir, LEDGER_DIR).glob(f"{EVAL_LEDGER_PREFIX}*.jsonl"))


def read_eval_steps(path: str | os.PathLike) -> Dict[int, Tuple[List[str], Optional[List[str]]]]:
    """step -> (ids, keys) one rank scored (keys None in a ledger written before them); a resumed session's
    evaluations replace those it repeats. Lines are read within bounds (`ledger_records`: DataError at file:line)."""
    return _read_eval(path)[0]


def _read_eval(path: str | os.PathLike) -> Tuple[Dict[int, Tuple[List[str], Optional[List[str]]]],
                                                 Dict[int, Optional[int]]]:
    """read_eval_steps, and step -> the world size of the session that recorded it (None: not marked)."""
    steps: Dict[int, Tuple[List[str], Optional[List[str]]]] = {}
    worlds: Dict[int, Optional[int]] = {}
    new_session, world = False, None
    for rec in ledger_records(path, ("step",)):
        if "session" in rec:
            new_session, world = True, rec.get("world_size")
            world = world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else None
            continue
        if new_session:
            steps = {s: v for s, v in steps.items() if s < rec["step"]}
            new_session = False
        steps[rec["step"]] = ([str(i) for i in rec["ids"]], [str(k) for k in rec["keys"]] if "keys" in rec else None)
        worlds[rec["step"]] = world
    return steps, {s: worlds[s] for s in steps}


def _per_rank(files: List[Path]) -> Dict[int, Dict[int, Tuple[List[str], Optional[List[str]]]]]:
    """Each rank's evaluations; those of a rank outside the world that evaluated that step (rank 0's session there
    names its world size: a resume or a fresh start at another world size) are a retired session's, replaced by
    the new world's, and left out."""
    per_rank = {int(p.stem[len(EVAL_LEDGER_PREFIX):]) if p.stem[len(EVAL_LEDGER_PREFIX):].isdigit() else -1 - i:
                _read_eval(p) for i, p in enumerate(files)}
    worlds = per_rank[0][1] if 0 in per_rank else {}
    return {r: {s: v for s, v in steps.items() if worlds.get(s) is None or r < worlds[s]}
            for r, (steps, _) in per_rank.items()}


def read_eval_ledger(path: str | os.PathLike) -> Dict[int, List[str]]:
    """step -> ids one rank scored."""
    return {step: ids for step, (ids, _keys) in read_eval_steps(path).items()}


@dataclass
class EvalReport(Verdict):
    ranks: int = 0
    steps: List[int] = field(default_factory=list)  # the evaluations, by the step they were made at

    def summary(self) -> str:
        lines = [f"evaluation ledger: {self.ranks} rank(s), {len(self.steps)} evaluation(s) at steps {self.steps[:20]}"
                 f"{' ...' if len(self.steps) > 20 else ''}; each must score the same samples, each once across ranks"]
        return "\n".join(lines + self.verdict_lines())


def check_eval_ledgers(run_dir: str | os.PathLike, expected_ids: Optional[Iterable[str]] = None) -> EvalReport:
    """Every evaluation the run recorded scored each sample once across ranks (its keys; a ledger without them, its
    ids), the same samples (ids) as the first evaluation, and with `expected_ids` exactly those ids."""
    report = EvalReport()
    files = eval_ledger_files(run_dir)
    if not files:
        report.problems.append(f"no evaluation ledgers in {Path(run_dir, LEDGER_DIR)} (trainer.record_samples=true?)")
        return report
    report.ranks = len(files)
    ids, dealt = tally((step, step_ids, keys) for steps in _per_rank(files).values()
                       for step, (step_ids, keys) in steps.items())
    report.steps = sorted(ids)
    first = None if expected_ids is None else Counter(set(expected_ids))  # expected: each id at least once
    for step in report.steps:
        _check_once(report, step, ids[step], dealt[step])
        first = ids[step] if first is None else first
        differ = _differing(ids[step], first, counted=expected_ids is None)
        if differ:
            report.problems.append(f"evaluation at step {step}: scored {sum(ids[step].values())} samples, not the "
                                   f"same set as the others ({len(differ)} ids differ, e.g. {differ[:3]})")
    return report


def _check_once(report: EvalReport, step: int, ids: Counter, keys: Optional[Counter]) -> None:
    """No position scored twice in the evaluation at `step` (the ids, for a ledger without positions); ids naming
    several samples are a note, not a violation."""
    twice = sorted(i for i, n in (ids if keys is None else keys).items() if n > 1)
    if twice:
        what = "samples" if keys is None else "samples (rows of the validation data)"
        report.problems.append(f"evaluation at step {step}: {len(twice)} {what} scored more than once, e.g. "
                               f"{twice[:5]}")
    elif keys is not None and len(ids) < sum(ids.values()):
        shared = sorted(i for i, n in ids.items() if n > 1)
        report.notes.append(f"evaluation at step {step}: {len(shared)} ids name more than one sample (e.g. "
                            f"{shared[:3]}: files of the same name, or an id column that repeats); each sample was "
                            "scored once")


def _differing(ids: Counter, reference: Counter, counted: bool) -> List[str]:
    """Ids scored in one of the two but not the other; `counted`: also those scored a different number of times."""
    return sorted(i for i in ids.keys() | reference.keys()
                  if (ids[i] != reference[i] if counted else not (ids[i] and reference[i])))


def verify_eval_ledgers(run_dir: str | os.PathLike, expected_ids: Optional[Iterable[str]] = None) -> List[str]:
    """Problems with the evaluations a run recorded (empty: `check_eval_ledgers` found none)."""
    return check_eval_ledgers(run_dir, expected_ids).problems
