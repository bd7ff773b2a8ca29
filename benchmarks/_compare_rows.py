"""Which runs of benchmarks/gpu_compare.py count, and how they are shown (not a benchmark itself).

Owner: benchmarks/. The same rules for every system, so that neither side's failure flatters the other:

  timed_after(steps)    the last untimed step, the same for every system (a log line of dsrecipes' ends there);
  counted(row, steps)   a run's tokens/s counts only when it exited 0 after all its steps; a failed, timed-out or
                        short run keeps what it measured as `tokens_per_s_partial` and `not_counted` says why (a
                        dsrecipes run that died at step 12 would otherwise show the rate of its first windows, while
                        a failed TRL run, which writes its row at the end, shows none);
  with_oom_retries(...) a run that ran out of GPU memory runs again at half the micro-batch and twice the gradient
                        accumulation (the same tokens per optimizer step), as its user would, while the budget lasts:
                        a micro-batch chosen for one side must not turn the other side's row into a missing one;
  ratio_table(rows)     failed runs are printed as `fail`, not as a blank, and each cell's footnotes say which run
                        failed and which TRL variant its "TRL best" is;
  plot(rows, path)      a failed run is a labelled gap, never a bar of height 0 (which reads as "0 tokens/s").
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

OOM_MARKS = ("out of memory", "outofmemoryerror")  # torch's CUDA message and exception name (lower case)
SYSTEMS = ("dsrecipes", "dsrecipes_levers", "trl_best", "trl_best_flex", "trl_plain", "bare")


def log_every(steps: int) -> int:
    """Optimizer steps between log lines, dsrecipes' `trainer.log_every` and TRL's `logging_steps` alike."""
    return max(steps // 6, 1)


def timed_after(steps: int) -> int:
    """The last untimed optimizer step, the same for every system: the first third, down to a step where dsrecipes
    writes a log line (its windows start there only), so that every side times steps timed_after + 1 .. steps."""
    every = log_every(steps)
    return steps // 3 // every * every


def counted(row: Dict[str, Any], steps: int) -> Dict[str, Any]:
    """`row` with `tokens_per_s` (and `mfu`) kept only for a run that exited 0 after all `steps` optimizer steps."""
    why = None
    if row.get("exit") != 0:
        why = f"exit {row.get('exit')}"
    elif row.get("steps") != steps:
        why = f"{row.get('steps')} of {steps} steps"
    if why is None:
        return row
    out = {**row, "not_counted": why, "tokens_per_s": None, "mfu": None}
    if row.get("tokens_per_s") is not None:
        out["tokens_per_s_partial"] = row["tokens_per_s"]
    return out


def ran_out_of_memory(logs: Iterable[Path]) -> bool:
    """Whether any of these logs (the last 64 KiB of each) says that CUDA ran out of memory."""
    for log in logs:
        try:
            with open(log, "rb") as fh:
                fh.seek(0, 2)
                fh.seek(max(fh.tell() - 65536, 0))
                text = fh.read().decode("utf-8", "replace").lower()
        except OSError:
            continue
        if any(mark in text for mark in OOM_MARKS):
            return True
    return False


def with_oom_retries(run: Callable[[int, int], Tuple[Dict[str, Any], List[Path]]], micro_batch: int,
                     grad_accum: int, deadline: float, note: Callable[[str], None], label: str) -> Dict[str, Any]:
    """`run(micro_batch, grad_accum)` -> (row, its logs); again at half the micro-batch and twice the accumulation
    while it failed out of memory, the micro-batch is even and `deadline` (time.time()) is not passed. The row says
    the sizes it ran out of memory at (`oom_at`); each retry is noted."""
    oom_at: List[int] = []
    while True:
        row, logs = run(micro_batch, grad_accum)
        if row.get("exit") == 0 or not ran_out_of_memory(logs):
            break
        oom_at.append(micro_batch)
        if micro_batch % 2 or time.time() > deadline:
            note(f"{label}: out of memory at micro-batch {micro_batch} x grad_accum {grad_accum}; not retried "
                 f"({'odd micro-batch' if micro_batch % 2 else 'time budget spent'})")
            break
        note(f"{label}: out of memory at micro-batch {micro_batch} x grad_accum {grad_accum}; run again at "
             f"{micro_batch // 2} x {grad_accum * 2} (the same tokens per optimizer step)")
        micro_batch, grad_accum = micro_batch // 2, grad_accum * 2
    return {**row, "oom_at": oom_at} if oom_at else row


def _fmt(v: Optional[float], fmt: str = ".0f") -> str:
    return format(v, fmt) if v else "-"


def ratio_table(rows: List[Dict[str, Any]]) -> str:
    """Per cell: dsrecipes' default recipe (the ratios' numerator: no levers, no tuning), the levers, TRL at its
    best (the faster of trl_best and trl_best_flex where both counted), TRL's defaults and the bare loop; `fail`
    where a run did not count. Footnotes per cell: the runs that did not count and which variant "TRL best" is."""
    lines = ["model          ZeRO  dsrecipes tok/s  MFU    levers tok/s  trl_best  trl_plain  bare   ds/trl_best "
             "ds/trl_plain  levers/trl_best"]
    notes: List[str] = []
    for model, zero in sorted({(r["model"], r["zero"]) for r in rows}):
        by = {r["system"]: r for r in rows if (r["model"], r["zero"]) == (model, zero)}
        tps = {k: r.get("tokens_per_s") for k, r in by.items()}
        best = max((k for k in by if k.startswith("trl_best") and tps[k]), key=lambda k: tps[k], default=None)
        trl_best = tps[best] if best else None

        def cell(system: Optional[str], value: Optional[float], fmt: str = ".0f") -> str:
            return "fail" if system in by and not value else _fmt(value, fmt)

        def ratio(num, den, mark=""):
            return _fmt(num / den if num and den else None, ".2f") + (mark if num and den else "")
        ds = tps.get("dsrecipes")
        tried = [k for k in by if k.startswith("trl_best")]
        attn = (by[best].get("settings") or {}).get("attn_implementation") if best else None
        star = "*" if attn and attn != "flash_attention_2" else ""  # TRL's padding-free path outside its support
        lines.append(f"{model:<14} {zero:<5} {cell('dsrecipes', ds):>15}  "
                     f"{_fmt(by.get('dsrecipes', {}).get('mfu'), '.1%'):>5}  "
                     f"{cell('dsrecipes_levers', tps.get('dsrecipes_levers')):>12}  "
                     f"{cell(tried[0] if tried else None, trl_best):>8}  {cell('trl_plain', tps.get('trl_plain')):>9}  "
                     f"{cell('bare', tps.get('bare')):>5}  {ratio(ds, trl_best, star):>11} "
                     f"{ratio(ds, tps.get('trl_plain')):>12} {ratio(tps.get('dsrecipes_levers'), trl_best, star):>16}")
        for system, r in by.items():
            if r.get("not_counted"):
                oom = f", out of memory at micro-batch {r['oom_at']}" if r.get("oom_at") else ""
                notes.append(f"  {model} ZeRO-{zero}: {system} not counted ({r['not_counted']}{oom})")
            elif r.get("oom_at"):
                notes.append(f"  {model} ZeRO-{zero}: {system} ran at micro-batch {r.get('micro_batch')} x grad_accum "
                             f"{r.get('grad_accum')} (out of memory at {r['oom_at']})")
        if best and len(tried) > 1:
            notes.append(f"  {model} ZeRO-{zero}: TRL best = {best} (of {', '.join(tried)})")
        if star:
            notes.append(f"  * {model} ZeRO-{zero}: TRL best ran on {attn}, not flash-attention 2 (SFTConfig: padding-free "
                         "batches are supported with FlashAttention 2 or 3 only): not TRL's best, and a ratio over it "
                         "flatters dsrecipes")
    return "\n".join(lines + (["notes:"] + notes if notes else []))


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    """tokens/s bars per cell and system; a run that did not count is a gap labelled `fail`, not a bar of 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["model"], r["zero"]) for r in rows})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    fig, ax = plt.subplots(figsize=(2 + 2 * len(cells), 4))
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        found = [next((r for r in rows if (r["model"], r["zero"], r["system"]) == (m, z, system)), None)
                 for m, z in cells]
        xs = [c + i * width for c in range(len(cells))]
        ax.bar(xs, [(r or {}).get("tokens_per_s") or 0 for r in found], width, label=system)
        for x, r in zip(xs, found):
            if r is not None and not r.get("tokens_per_s"):
                ax.text(x, 0, "fail", rotation=90, ha="center", va="bottom", fontsize=7)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cells))], [f"{m}\nZeRO-{z}" for m, z in cells])
    ax.set_ylabel("tokens/s (runs that exited 0 after all steps)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
