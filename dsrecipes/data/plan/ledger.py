"""Sample ledger (`trainer.record_samples=true`): which sample ids each rank trained on, per optimizer step.

Each rank appends `{"epoch": e, "step": s, "ids": [...], "keys": [...]}` lines to `<run>/ledger/rank<R>.jsonl` (one
line per `record` call; the runner calls it per micro-batch, several lines of one step are merged when reading).
`ids` are the samples' ids as the data names them (an `id` column, else `file:line`), which need not be unique: two
files named `train.jsonl` in different folders, or a data set that repeats an id. `keys` are the positions the
strategy dealt, unique by construction (map: the prepared row; iterable: file index, line and copy; presharded: the
rank's part and line), so the exactly-once check counts keys; a ledger without them (written before) counts ids. Every
process that opens a ledger first writes a `{"session": ...}` line: after a resume, the steps it records again replace
what the interrupted session had recorded from that step on, so the ledger shows what the model finally trained on.

This ledger and the evaluation ledger (eval_ledger.py) are read line by line through `ledger_records` (a line within
MAX_LEDGER_LINE bytes, JSON within its nesting bound, a record of the right shape; else one DataError at file:line).

`verify_ledgers(run_dir)` checks the data guarantees on a finished run: no key twice within an epoch across ranks,
the same steps on every rank, and (with `expected_ids`) every sample read except less than one global batch.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar

from dsrecipes.core.errors import DataError
from dsrecipes.core.fileio import MAX_JSON_BYTES, loads_bounded, open_append

LEDGER_DIR = "ledger"
MAX_LEDGER_LINE = MAX_JSON_BYTES  # one line: a micro-batch's ids (training), or a rank's share of an evaluation
_Ledger = TypeVar("_Ledger", bound="LedgerFile")


class LedgerFile:
    """One rank's append-only ledger file `<run>/ledger/<name>`, line-buffered (a crash loses no line); the process
    that opens it first writes a session mark. The training ledger (`LedgerWriter`) and the evaluation ledger
    (data/plan/eval_ledger.py `EvalLedger`) write their records through `write`."""

    def __init__(self, run_dir: str | os.PathLike, name: str, world_size: Optional[int] = None):
        self.path = Path(run_dir) / LEDGER_DIR / name
        self._fh = open_append(self.path, buffering=1)
        mark: Dict[str, object] = {"session": time.time(), "pid": os.getpid()}
        if world_size is not None:  # the ranks that run this session's steps (an elastic resume changes them)
            mark["world_size"] = int(world_size)
        self._fh.write(json.dumps(mark) + "\n")

    def write(self, rec: Dict[str, object], ids: Sequence[str], keys: Optional[Sequence[str]]) -> None:
        """`rec` with the sample ids and, when the loader dealt them, their positions (`keys`)."""
        rec["ids"] = list(ids)
        if keys is not None:
            rec["keys"] = [str(k) for k in keys]
        self._fh.write(json.dumps(rec, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self: _Ledger) -> _Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LedgerWriter(LedgerFile):
    def __init__(self, run_dir: str | os.PathLike, rank: int, world_size: Optional[int] = None):
        super().__init__(run_dir, f"rank{rank}.jsonl", world_size)

    def record(self, epoch: int, step: int, ids: Sequence[str], keys: Optional[Sequence[str]] = None) -> None:
        self.write({"epoch": int(epoch), "step": int(step)}, ids, keys)


def read_ledger(path: str | os.PathLike) -> Dict[Tuple[int, int], List[str]]:
    """(epoch, step) -> ids of one rank, in step order, with resumed sessions replacing replayed steps."""
    return {step: ids for step, (ids, _keys) in read_ledger_steps(path).items()}


def read_ledger_steps(path: str | os.PathLike) -> Dict[Tuple[int, int], Tuple[List[str], Optional[List[str]]]]:
    """(epoch, step) -> (ids, keys) of one rank; keys None when a line of the step has none (an older ledger)."""
    return _read_steps(path)[0]


def _read_steps(path: str | os.PathLike) -> Tuple[Dict[Tuple[int, int], Tuple[List[str], Optional[List[str]]]],
                                                  Dict[Tuple[int, int], Optional[int]]]:
    """read_ledger_steps, and (epoch, step) -> the world size of the session that recorded it (None: not marked)."""
    steps: Dict[Tuple[int, int], Tuple[List[str], Optional[List[str]]]] = {}
    worlds: Dict[Tuple[int, int], Optional[int]] = {}
    new_session, world = False, None
    for rec in ledger_records(path, ("epoch", "step")):
        if "session" in rec:
            new_session, world = True, rec.get("world_size")
            world = world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else None
            continue
        key = (rec["epoch"], rec["step"])
        if new_session:  # the first step of a resumed session: forget what was recorded from there on
            steps = {k: v for k, v in steps.items() if k[1] < rec["step"]}
            new_session = False
        worlds[key] = world
        ids, keys = steps.setdefault(key, ([], []))
        ids.extend(rec["ids"])
        if keys is not None and isinstance(rec.get("keys"), list):
            keys.extend(rec["keys"])
        else:
            steps[key] = (ids, None)
    return steps, {k: worlds[k] for k in steps}


def ledger_records(path: str | os.PathLike, numbers: Tuple[str, ...]) -> Iterator[Dict]:
    """The records of one ledger file, in order: session marks, and records with whole `numbers` (training: epoch and
    step; evaluation: step), a list of sample ids and maybe of keys. Read line by line, each line within
    MAX_LEDGER_LINE bytes (never a whole file or line into memory first); anything else is one DataError naming
    file:line (`audit --ledger` reads a run directory it did not write)."""
    with open(path, "rb") as fh:
        for line_no, line in enumerate(iter(lambda: fh.readline(MAX_LEDGER_LINE + 1), b""), 1):
            if len(line) > MAX_LEDGER_LINE:
                raise DataError(f"{path}:{line_no}: not a ledger record (a line of more than {MAX_LEDGER_LINE >> 20} "
                                "MiB)")
            if line.strip():
                yield _record(path, line_no, line.decode("utf-8", errors="replace"), numbers)


def _record(path: str | os.PathLike, line_no: int, line: str, numbers: Tuple[str, ...]) -> Dict:
    """One ledger line: a session mark, or {numbers: whole numbers, ids (and keys): names}; else DataError at
    file:line."""
    try:
        rec = loads_bounded(line, "JSON nested too deeply")  # 100000 '[' was json's RecursionError traceback
    except ValueError as exc:
        raise DataError(f"{path}:{line_no}: not a ledger record (not JSON: {str(exc)[:80]})") from None
    if isinstance(rec, dict) and ("session" in rec or (
            all(isinstance(rec.get(k), int) and not isinstance(rec.get(k), bool) for k in numbers)
            and all(_names(rec.get(k)) for k in ("ids", "keys") if k == "ids" or k in rec))):
        return rec
    raise DataError(f"{path}:{line_no}: not a ledger record (a session mark, or {' and '.join(numbers)} "
                    f"number{'s' if len(numbers) > 1 else ''} and a list of sample ids)")


def _names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in value)


@dataclass
class Verdict:
    """What a ledger check found: problems (violations) and notes; its summary ends with them and OK or FAILED."""

    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def verdict_lines(self) -> List[str]:
        lines = [f"  note: {n}" for n in self.notes[:5]]
        lines += [f"  VIOLATION {p}" for p in self.problems[:20]]
        lines.append("OK" if self.ok else f"FAILED ({len(self.problems)} problems)")
        return lines


@dataclass
class LedgerReport(Verdict):
    ranks: int = 0
    steps_per_rank: Dict[int, int] = field(default_factory=dict)
    samples_per_rank: Dict[int, int] = field(default_factory=dict)
    epochs: List[int] = field(default_factory=list)
    duplicates: Dict[int, List[str]] = field(default_factory=dict)  # epoch -> ids read more than once
    missing: Dict[int, int] = field(default_factory=dict)  # epoch -> expected ids never read
    unexpected: Dict[int, List[str]] = field(default_factory=dict)  # epoch -> ids outside expected_ids
    step_numbers: Set[int] = field(default_factory=set)  # the optimizer steps the lowest rank recorded

    def summary(self) -> str:
        lines = [f"ledger: {self.ranks} rank(s), epochs {self.epochs}"]
        for r in sorted(self.steps_per_rank):
            lines.append(f"  rank {r}: {self.steps_per_rank[r]} steps, {self.samples_per_rank[r]} samples")
        for e in self.epochs:
            if e in self.missing:
                lines.append(f"  epoch {e}: {self.missing[e]} expected samples not read")
        return "\n".join(lines + self.verdict_lines())


def tally(entries: Iterable[Tuple[int, Sequence[str], Optional[Sequence[str]]]]
          ) -> Tuple[Dict[int, Counter], Dict[int, Optional[Counter]]]:
    """Per group (an epoch; an evaluation, by its step) of (group, ids, keys) lines: how often each id was read and
    each key dealt (None for a group with a line without keys: a ledger written before they were recorded)."""
    ids: Dict[int, Counter] = defaultdict(Counter)
    dealt: Dict[int, Optional[Counter]] = {}
    for group, group_ids, keys in entries:
        ids[group].update(group_ids)
        held = dealt.setdefault(group, Counter())
        if keys is None:
            dealt[group] = None
        elif held is not None:
            held.update(keys)
    return ids, dealt


def verify_ledgers(
    run_dir: str | os.PathLike,
    expected_ids: Optional[Iterable[str]] = None,
    global_batch: Optional[int] = None,
    complete_epochs: Optional[Iterable[int]] = None,
) -> LedgerReport:
    """Check `<run_dir>/ledger/rank*.jsonl`.

    Always: equal step lists on every rank, no id twice within an epoch (across ranks and steps). With
    `expected_ids`: no id outside them, and for each epoch in `complete_epochs` (default: every epoch but the last
    one seen, which a step budget may cut short) fewer than `global_batch` of them unread (any number if None).
    """
    report = LedgerReport()
    files = sorted(Path(run_dir, LEDGER_DIR).glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    if not files:
        report.problems.append(f"no ledger files in {Path(run_dir, LEDGER_DIR)} (trainer.record_samples=true?)")
        return report
    read = {int(p.stem[4:]): _read_steps(p) for p in files}
    per_rank = {r: steps for r, (steps, _) in read.items()}
    report.ranks = len(per_rank)
    if sorted(per_rank) != list(range(len(per_rank))):
        report.problems.append(f"ledger ranks are {sorted(per_rank)}, expected 0..{len(per_rank) - 1}")
    _check_steps(report, per_rank, read[min(read)][1])
    by_epoch, dealt = tally((epoch, ids, keys) for steps in per_rank.values()
                            for (epoch, _), (ids, keys) in steps.items())
    report.epochs = sorted(by_epoch)
    expected: Optional[Set[str]] = None if expected_ids is None else set(expected_ids)
    complete = set(report.epochs[:-1]) if complete_epochs is None else set(complete_epochs)
    for epoch in report.epochs:
        counts = by_epoch[epoch]
        _check_once(report, epoch, counts, dealt[epoch])
        if expected is None:
            continue
        extra = sorted(set(counts) - expected)
        if extra:
            report.unexpected[epoch] = extra
            report.problems.append(f"epoch {epoch}: {len(extra)} ids not in the dataset, e.g. {extra[:5]}")
        missing = len(expected - set(counts))
        report.missing[epoch] = missing
        if epoch in complete and global_batch is not None and missing >= global_batch:
            report.problems.append(f"epoch {epoch}: {missing} samples never read (>= one global batch of {global_batch})")
    return report




def _check_steps(report: LedgerReport, per_rank: Dict[int, Dict[Tuple[int, int], Tuple[List[str], Optional[List[str]]]]],
                 worlds: Dict[Tuple[int, int], Optional[int]]) -> None:
    """Every rank ran the steps of the lowest rank that its world ran: a resume at another world size (session marks
    with `world_size`) leaves a rank outside the new world without its later steps, and what such a rank had recorded
    past the resumed checkpoint was replayed by the new world, so it is dropped (in place) rather than counted."""
    ref = min(per_rank)
    report.step_numbers = {step for _, step in per_rank[ref]}
    for r, steps in per_rank.items():
        for key in [k for k in steps if r != ref and worlds.get(k) is not None and r >= worlds[k]]:
            del steps[key]
        report.steps_per_rank[r] = len(steps)
        report.samples_per_rank[r] = sum(len(ids) for ids, _ in steps.values())
    for r, steps in per_rank.items():
        expected = sorted(k for k in per_rank[ref] if worlds.get(k) is None or r < worlds[k])
        if sorted(steps) != expected:
            only = sorted(set(steps) ^ set(expected))[:5]
            report.problems.append(f"rank {r} ran {len(steps)} steps, rank {ref} ran {len(expected)} in its worlds; "
                                   f"(epoch, step) differing: {only}")
    order = [w for _, w in sorted(worlds.items()) if w is not None]
    changes = [w for i, w in enumerate(order) if i == 0 or w != order[i - 1]]
    if len(changes) > 1:
        report.notes.append(f"the run resumed at another world size ({' -> '.join(map(str, changes))} ranks); each "
                            "step is checked against the ranks that ran it")


def _check_once(report: LedgerReport, epoch: int, ids: Counter, keys: Optional[Counter]) -> None:
    """No position dealt twice in `epoch` (the ids, for a ledger without positions); ids naming several samples are
    a note, not a violation."""
    dups = sorted(i for i, n in (ids if keys is None else keys).items() if n > 1)
    if dups:
        report.duplicates[epoch] = dups
        what = "ids" if keys is None else "samples (file:line, or row of the prepared data)"
        report.problems.append(f"epoch {epoch}: {len(dups)} {what} read more than once, e.g. {dups[:5]}")
    elif keys is not None and len(ids) < sum(ids.values()):
        shared = sorted(i for i, n in ids.items() if n > 1)
        report.notes.append(f"epoch {epoch}: {len(shared)} ids name more than one sample (e.g. {shared[:3]}: files "
                            "of the same name, or an id column that repeats); each sample was read once")
