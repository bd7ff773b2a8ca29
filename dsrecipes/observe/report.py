"""The closing summary a finished run prints: what it did (steps, losses, wall time, tokens/s), where its files are,
and the next commands (compare with the start, chat, train further from the last checkpoint).

Numbers come from `rundir.run_summary()` (metrics.jsonl), the one place that computes a run's headline numbers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from dsrecipes.boundary.checkpoint_find import committed, trust_to_repeat
from dsrecipes.config.defaults import local_dir
from dsrecipes.core.console import LOGS_DIR
from dsrecipes.core.errors import UserError
from dsrecipes.core.export_dir import EXPORT_BEST_DIR, EXPORT_DIR, scorer_architecture
from dsrecipes.core.rundir import CHECKPOINTS_DIR, RESULT_FILE, read_metrics, run_summary
from dsrecipes.core.runplan import read_plan
from dsrecipes.observe.headline import fmt, logged
from dsrecipes.observe.metrics import format_seconds

LOSS_PLOT = "loss.png"


def closing_summary(run_dir: Path, wall_s: float, overrides: Sequence[str], max_steps: Optional[int],
                    epochs: int = 1) -> str:

    summary = run_summary(run_dir)
    rows = read_metrics(run_dir)
    eval_rows = [r for r in rows if r.get("eval_loss") is not None]
    speed = f" at {summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else ""
    start = _resumed_at(run_dir)
    resumed = f" ({summary['steps'] - start} in this run, resumed at step {start})" if start else ""
    lines = [f"done: {summary['steps']} steps{resumed} in {format_seconds(wall_s)}{speed}"]
    if train := trend(rows, "loss"):
        lines.append(f"  train loss   {train}")
    lines += headline_lines(rows, "", "train")
    if eval_rows:
        lines += eval_lines(eval_rows)
    lines += selection_lines(run_dir)
    lines.append(f"  run dir      {run_dir}")
    export = run_dir / EXPORT_DIR
    if export.is_dir():
        lines.append(f"  model        {export}  (Hugging Face format)")
    if (run_dir / LOSS_PLOT).is_file():
        lines.append(f"  loss curves  {run_dir / LOSS_PLOT}")
    hidden = _hidden_lines(run_dir)
    if hidden:
        lines.append(f"  hidden logs  {run_dir / LOGS_DIR}  ({hidden} third-party line{'s' * (hidden != 1)} kept off "
                     "the console)")
    lines += ["next:"] + [f"  {what:<15}{cmd}" for what, cmd in next_commands(run_dir, overrides, summary["steps"],
                                                                              max_steps, epochs)]
    return "\n".join(lines)


def _resumed_at(run_dir: Path) -> int:
    """The step this invocation continued from (plan.json), 0 for a run from the start: 'done: 60 steps in 24s'
    after a resume at step 51 read as 60 steps in 24 s."""
    try:
        plan = read_plan(run_dir)
    except UserError:
        return 0
    return plan.resume.step if plan.resume is not None else 0


def eval_lines(eval_rows: List[dict]) -> List[str]:
    """First -> last evaluation (step 0 is the starting weights), how many ran, and accuracy/perplexity."""
    first, last = eval_rows[0], eval_rows[-1]
    if len(eval_rows) == 1:  # one evaluation is not a trend: "7.5 -> 7.5" would claim a curve it never measured
        lines = [f"  eval loss    {first['eval_loss']:.4f}  (1 evaluation, step {first['step']})"]
    else:
        count = f"{len(eval_rows)} evaluations, steps {first['step']}..{last['step']}"
        lines = [f"  eval loss    {first['eval_loss']:.4f} -> {last['eval_loss']:.4f}  ({count})"]
    if first.get("eval_accuracy") is not None and last.get("eval_accuracy") is not None:
        lines.append(f"  eval acc     {first['eval_accuracy']:.1%} -> {last['eval_accuracy']:.1%}  (perplexity "
                     f"{first.get('eval_ppl', float('nan')):.4g} -> {last.get('eval_ppl', float('nan')):.4g})")
    return lines + headline_lines(eval_rows, "eval_", "eval")


def headline_lines(rows: List[dict], prefix: str, what: str) -> List[str]:
    """The objective's headline numbers (observe/headline.py: reward accuracy and margin of the preference
    objectives, GRPO's reward), first -> last, as the loss is shown: `  train reward_acc 50.0% -> 87.5%  (...)`."""
    return [f"  {f'{what} {label}':<12} {trend(rows, key, spec)}" for key, label, spec in logged(rows, prefix)]


def selection_lines(run_dir: Path) -> List[str]:
    """The best checkpoint and early stopping, as result.json records them."""


    try:
        result = json.loads((run_dir / RESULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(result, dict):
        return []
    best = run_dir / EXPORT_BEST_DIR
    return summary_lines(result, str(best) if best.is_dir() else None)


def trend(rows: Sequence[dict], key: str, spec: str = ".4f") -> Optional[str]:
    """First and last logged value of `key` and how many there were: a run shorter than trainer.log_every logged
    once, and "7.16 -> 7.16" would claim a flat curve it never measured. `spec`: headline.fmt's ("pct": 62.5%)."""
    values = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if not values:
        return None
    (first_step, first), (last_step, last) = values[0], values[-1]
    if len(values) == 1:
        return f"{fmt(first, spec)}  (1 logged value, step {first_step})"
    return (f"{fmt(first, spec)} -> {fmt(last, spec)}  (first and last of {len(values)} logged values, steps "
            f"{first_step}-{last_step})")


def next_commands(run_dir: Path, overrides: Sequence[str], steps: int, max_steps: Optional[int],
                  epochs: int = 1) -> List[tuple]:
    run = shlex.quote(str(run_dir))
    out = []
    if (run_dir / EXPORT_DIR).is_dir() and scorer_architecture(run_dir / EXPORT_DIR):  # a reward model scores
        out.append(("score pairs:", f"dsrecipes score {shlex.quote(str(run_dir / EXPORT_DIR))} --pairs PAIRS.jsonl"))
    elif _scoring_adapter(run_dir / EXPORT_DIR):  # LoRA, trainer.export_merged_lora=false: merge it to score
        out.append(("score pairs:", f"dsrecipes export {run} --lora merged --out MERGED && dsrecipes score MERGED "
                                    "--pairs PAIRS.jsonl"))
    elif (run_dir / EXPORT_DIR).is_dir():
        out.append(("compare:", f"dsrecipes prompt-eval --baseline {run} --finetuned {run}"))
        out.append(("chat:", f"dsrecipes chat {run}"))
    out.append(("train further:", resume_command(run_dir, overrides, steps, max_steps, _stopped_early(run_dir),
                                                 epochs)))
    return out


def _scoring_adapter(export: Path) -> bool:
    """An adapter-only export of a reward model (peft's task_type SEQ_CLS): it neither chats nor scores as it is."""
    try:
        return json.loads((export / "adapter_config.json").read_text(encoding="utf-8")).get("task_type") == "SEQ_CLS"
    except (OSError, ValueError, AttributeError):
        return False


def _stopped_early(run_dir: Path) -> bool:
    try:
        result = json.loads((run_dir / RESULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and bool(result.get("stopped_early"))


def resume_command(run_dir: Path, overrides: Sequence[str], steps: int, max_steps: Optional[int],
                   stopped_early: bool = False, epochs: int = 1) -> str:
    """The same command, pointed at this run directory: it resumes from the newest complete checkpoint. A run
    that reached its step budget gets a doubled one (an epoch-based run, `max_steps` None: twice its `epochs`); a
    run that stopped early gets `trainer.early_stopping.patience=0`, which trains on to its budget (the same
    command would stop there again: run/resume_contract.check_budget refuses it). A run that saved a checkpoint
    continues from its own, so trainer.resume_from (another run's: run/entry.check_fresh_start refuses it into a
    directory that holds a run) is dropped; `--trust-checkpoint PATH` is repeated where the command loads again what
    this one loaded only because PATH was trusted (checkpoint_find.trust_to_repeat: a reward model export)."""
    keeps_resume_from = not committed(run_dir / CHECKPOINTS_DIR)
    dropped = ("trainer.output_dir", "trainer.max_steps", "hydra.run.dir") + (
        ("trainer.epochs",) if max_steps is None else ()) + (
        ("trainer.early_stopping.patience",) if stopped_early else ()) + (
        () if keeps_resume_from else ("trainer.resume_from",))
    kept = [absolute_override(o) for o in overrides if o.split("=", 1)[0].lstrip("+~") not in dropped]
    extra = [f"trainer.output_dir={run_dir}"] + (["trainer.early_stopping.patience=0"] if stopped_early else [])
    if max_steps is not None:
        extra.append(f"trainer.max_steps={max(max_steps, steps) * 2 if steps >= max_steps else max_steps}")
    else:  # the budget is its epochs: run/resume_contract.check_budget refuses the same one again
        extra += ["trainer.max_steps=null", f"trainer.epochs={epochs if stopped_early else epochs * 2}"]
    return shlex.join(["dsrecipes", *kept, *extra, *trust_to_repeat(run_dir, keeps_resume_from)])


MODEL_DIR_KEYS = ("model.path", "model.tokenizer_path")  # a local directory, else a hub id: absolute only if there
# keys naming local files and directories: a printed command repeats them absolute, to work from any directory. The
# dataset's (dataset.val_paths too) are recorded absolute (config/defaults.with_derived_defaults), so a resume sees
# no change; the others may change on a resume (run/resume_contract.MAY_CHANGE).
LOCAL_PATH_KEYS = ("dataset.paths", "dataset.val_paths", "dataset.registry", "data.shard_dir", "data.cache_dir",
                   "trainer.resume_from", "launcher.hostfile", "offload.nvme_path")


def absolute_override(override: str) -> str:
    """An override as a printed command repeats it: `model.path=runs/sft/export` -> `model.path=/abs/runs/sft/export`
    where it names a local directory (as config.yaml records it, config/defaults.local_dir), and the local paths of
    LOCAL_PATH_KEYS (`dataset.paths=[data/a.jsonl]` -> `dataset.paths=[/abs/data/a.jsonl]`; URLs, absolute paths,
    null and interpolations as typed): the command then works from any directory, not only the one it ran in.
    Was: relative data paths were repeated relative. A value this cannot read safely is kept as typed."""
    key, _, value = override.partition("=")
    bare = key.lstrip("+~")
    if bare in MODEL_DIR_KEYS and value and os.path.isdir(os.path.expanduser(value)):
        return f"{key}={local_dir(value)}"
    if bare not in LOCAL_PATH_KEYS or not value:
        return override
    if value.startswith("[") and value.endswith("]"):
        items = _list_items(value[1:-1])
        return override if items is None else f"{key}=[{','.join(_absolute_item(i) for i in items)}]"
    return f"{key}={_absolute_item(value)}"


def _list_items(inner: str) -> Optional[List[str]]:
    """The elements of a flat Hydra list `a,'b c',"d"` as typed (quotes kept); None for nesting or a broken quote."""
    items, current, quote = [], "", ""
    for char in inner:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[]{}":
            return None
        elif char == ",":
            items.append(current.strip())
            current = ""
            continue
        current += char
    if quote:
        return None
    return items + [current.strip()] if current.strip() or items else []


def _absolute_item(text: str) -> str:
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    raw = text[1:-1] if quoted else text
    if not raw or "://" in raw or "$" in raw or "\\" in raw or (raw == "null" and not quoted):
        return text
    absolute = os.path.abspath(os.path.expanduser(raw))
    if absolute == raw:
        return text
    if re.fullmatch(r"[\w./*?~+@:%-]+", absolute) and not quoted:
        return absolute
    quote = next((q for q in "'\"" if q not in absolute), None)
    return f"{quote}{absolute}{quote}" if quote else text


def _hidden_lines(run_dir: Path) -> int:
    logs = run_dir / LOGS_DIR
    if not logs.is_dir():
        return 0
    return sum(len(p.read_text(encoding="utf-8", errors="replace").splitlines()) for p in logs.glob("*.log"))


def summary_lines(result: Dict[str, Any], export_best: Optional[str]) -> List[str]:
    """The closing summary's lines about model selection, from result.json."""
    lines = []
    if result.get("best_metric") and result.get("best_step") is not None:
        where = f": {export_best}" if export_best else ""
        lines.append(f"  best         {result['best_metric']} {result['best_value']:.4f} at step "
                     f"{result['best_step']}{where}")
    if result.get("stopped_early"):
        lines.append(f"  stopped      {result['stopped_early']}")
    return lines
