"""What `data.prescan=false` does not give, said: at launch (one note) and in the refusal of a bad row met mid-run.

Without the pre-scan (stream/scan.py) no process reads the stream's rows before training, so nothing knows the
stream's bad rows or its prompt rows' references until a reader meets them in the epoch's shuffled order:

- `dataset.bad_rows=error` stops the run at the first bad row *training* meets (a DataLoader worker, mid-run), which
  need not be the first bad row of the files (what `data=map` and the pre-scan name, before training): the refusal
  says so, and names the row it met (`file:line: reason`).
- `dataset.bad_rows=skip` drops bad rows as they are met: no `<run>/quarantine.jsonl`, no count of them, no
  `dataset.max_bad_fraction` (the fraction of a stream nobody read).
- GRPO's note on prompt rows without a reference answer (`prepare/prompts.say_references`), and its refusal of a
  stream with none under rewards that compare with it, need every row read: not given.

Each of these needs the whole scan that `data.prescan=false` exists to avoid, so the launch says which of them apply
to the run (`unscanned_note`), and `data.prescan=true` (or `dsrecipes shard`) gives them all.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from dsrecipes.core.choices import RowKind
from dsrecipes.core.schema import BadRows, TrainConfig
from dsrecipes.data.prepare.build import QUARANTINE_FILE
from dsrecipes.data.prepare.prompts import REFERENCE_REWARDS
from dsrecipes.data.sources.badrows import ADVICE, Advice

QUARANTINE_NAME = f"<run>/{QUARANTINE_FILE}"
TRAINING = "training rows, read in the epoch's shuffled order"
VALIDATION = "share of the validation rows, read as the rank starts"


def unscanned_note(cfg: TrainConfig) -> Optional[str]:
    """The launch's note of what this stream does without the pre-scan (None with it)."""
    if cfg.data.prescan:
        return None
    gaps: List[str] = []
    if cfg.dataset.bad_rows is BadRows.error:
        gaps.append("a bad row stops the run mid-training when a reader meets it, in the epoch's shuffled order: "
                    "not necessarily the stream's first bad row, which the pre-scan names before training")
    else:
        gaps.append(f"bad rows are skipped as training meets them, with no {QUARANTINE_NAME}, no count and no "
                    f"dataset.max_bad_fraction={cfg.dataset.max_bad_fraction} check")
    needing = [r.name for r in cfg.objective.rewards if r.name in REFERENCE_REWARDS]
    if cfg.objective.rows is RowKind.prompt and needing:
        gaps.append(f"prompt rows without a reference answer (which objective.rewards {', '.join(needing)} "
                    "compare with) are neither counted nor said, and a stream with none is not refused: such a "
                    "row's completions score 0")
    return (f"note: data.prescan=false: rows are checked only as training reads them, so {'; '.join(gaps)}. "
            "data.prescan=true checks every row before training")


class RowsMetUnscanned:
    """A stream's row encoder (strategies/rows.py `row_encoder`) whose refusal of a bad row says it was met by
    training without the pre-scan, by which rank and in which part (TRAINING, VALIDATION). Picklable (DataLoader
    workers)."""

    def __init__(self, rows: Any, rank: int, part: str = TRAINING):
        self.rows, self.rank, self.part = rows, rank, part

    def __call__(self, items: Sequence[Any]) -> List[Any]:
        said = ADVICE.set(met_unscanned(self.rank, self.part))  # (the encoder's refusal is built with it)
        try:
            return self.rows(items)
        finally:
            ADVICE.reset(said)

    def __getattr__(self, name: str) -> Any:  # skipped, dropped, encoder: the encoder's
        if name == "rows":  # unpickling: no instance dict yet
            raise AttributeError(name)
        return getattr(self.rows, name)


def met_unscanned(rank: int, part: str) -> Advice:
    """The advice of the refusal of a bad row met by rank `rank` while reading its `part` (badrows.error_message),
    told as what it is: the first bad row that reading met, not necessarily the stream's first; skip's quarantine is
    not offered (a row of another kind keeps what reads it, then this)."""
    met = (f"the first bad row rank {rank} met in its {part}: with data.prescan=false rows are checked only as "
           "training reads them, so an earlier line of the stream may be bad too (data.prescan=true checks every row "
           "before training and names the first)")
    return Advice(own=f"{met}; fix or remove the row, or set dataset.bad_rows=skip to skip bad rows as training "
                      f"meets them (without the pre-scan: no {QUARANTINE_NAME}, no dataset.max_bad_fraction check)",
                  after=met)
