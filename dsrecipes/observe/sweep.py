"""Sweep summaries: `python -m dsrecipes -m zero=stage1,stage2 ...` ends with a table of every job.

Each Hydra job is a full run (compose -> prepare -> launch) in its own directory. This Hydra callback, registered in
conf/train.yaml under `hydra.callbacks`, makes sure every job leaves a `result.json` (a job that died before writing
one is recorded as failed, with its exception), and writes `summary.md` + `summary.json` into the sweep directory
after every job (so a sweep that is killed still has a table) and once more at the end, with `summary.png`: every
job's train and eval loss on one set of axes, labelled by its swept values. It reads only files, so
it works the same with launchers that run jobs in other processes or on other machines.

The result contract (written by dsrecipes.run.entry, one file per run, `<run>/result.json`):
    {"status": "ok" | "failed" | "dry_run", "error": str | null,
     "final_loss": float | null, "final_eval_loss": float | null, "tokens_per_s": float | null,
     "peak_mem_mb": float | null, ...}   (extra keys are kept)
`<run>/metrics.jsonl` (train lines with `step, loss, lr, grad_norm, tokens_per_s, samples_seen, elapsed, tokens`; eval lines
with `eval_loss`) fills any headline number result.json leaves null.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional, Set, Tuple

import yaml
from hydra.experimental.callback import Callback

from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import atomic_write_json, atomic_write_text
from dsrecipes.core.rundir import METRICS_FILE, RESULT_FILE, read_metrics, run_summary
from dsrecipes.observe.plots import plot_sweep

SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"
SUMMARY_PNG = "summary.png"
RESULT_KEYS = ("status", "error", "final_loss", "final_eval_loss", "tokens_per_s", "peak_mem_mb")
HEADLINE = ("final_loss", "final_eval_loss", "tokens_per_s", "peak_mem_mb")
# The accuracy a job's last evaluation reports, the first of these it has: a reward model's pair accuracy, DPO's
# implicit reward accuracy, SFT's next-token accuracy, prompt-eval's exact match (a column when a job has one).
ACCURACY_KEYS = ("eval_pair_accuracy", "eval_reward_accuracy", "eval_accuracy", "prompt_exact_match")
# What a sweep's job returns to Hydra (commands/train.py) when it had finished before this run of the sweep and was
# skipped, not run again: the callback marks that job `(earlier)` in the table; no file's time decides it.
FINISHED_EARLIER = "finished before this run of the sweep"


class SweepSummary(Callback):
    """Hydra callback: `hydra.callbacks.sweep_summary._target_: dsrecipes.observe.sweep.SweepSummary`."""

    def __init__(self) -> None:
        self.earlier: Set[Path] = set()  # the job directories this run of the sweep skipped (FINISHED_EARLIER)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.earlier = set()

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        dirs = job_run_dirs(config)
        if job_return.status == JobStatus.COMPLETED and getattr(job_return, "_return_value", None) == FINISHED_EARLIER:
            self.earlier.add(dirs[-1].resolve())
        if not any((d / RESULT_FILE).is_file() for d in dirs):
            failed = job_return.status == JobStatus.FAILED
            error = repr(job_return._return_value) if failed else "the job ended without writing result.json"
            try:
                atomic_write_json(dirs[-1] / RESULT_FILE, {**dict.fromkeys(RESULT_KEYS), "status": "failed",
                                                           "error": error})
            except OSError:  # a full disk: the run said it (else Hydra warns, quoting a line of its own source)
                pass
        if _is_multirun(config):
            write_summary(Path(str(config.hydra.sweep.dir)), self.earlier)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            rows = write_summary(sweep_dir, self.earlier)
            print(f"\nsweep summary ({sweep_dir / SUMMARY_MD}):\n")
            print(render_markdown(rows))
            if (sweep_dir / SUMMARY_PNG).is_file():
                print(f"\nloss curves of every job: {sweep_dir / SUMMARY_PNG}")


def _is_multirun(config: Any) -> bool:
    from omegaconf import OmegaConf  # lazy: else `sweep` imports omegaconf 0.06 s

    return _multirun_job(OmegaConf.select(config, "hydra", default=None))


def _multirun_job(hydra: Any) -> bool:
    """A job's `hydra` node says it is a multirun's: `hydra.mode` MULTIRUN (Hydra's own `-m` adds that override), or,
    with no mode, a job number, which only a sweep's launcher gives (config/hydra_app.multirun calls Hydra.multirun
    without the override, so its jobs have no mode; a single run's is RUN)."""
    from omegaconf import OmegaConf  # lazy: else `sweep` imports omegaconf 0.06 s

    if hydra is None:
        return False
    mode = OmegaConf.select(hydra, "mode", default=None)
    if mode is not None:
        return str(mode).endswith("MULTIRUN")  # (Hydra's RunMode.MULTIRUN, or its name read back from a file)
    return OmegaConf.select(hydra, "job.num", default=None) is not None


def in_sweep() -> bool:
    """This process is running a sweep's job now: Hydra is initialised (a multirun clears it when it ends) and the
    job it entered is a multirun's (`_multirun_job`). run/launch/process.py then runs a local rank as a child."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    if not (GlobalHydra.instance().is_initialized() and HydraConfig.initialized()):
        return False
    return _multirun_job(HydraConfig.get())


def job_run_dirs(config: Any) -> List[Path]:
    """Where a job's files may be: trainer.output_dir when set (resolved like the entry does), then Hydra's dir."""
    from omegaconf import OmegaConf  # lazy: else `sweep` imports omegaconf 0.06 s

    return _candidates(OmegaConf.select(config, "trainer.output_dir", default=None), config.hydra.runtime.output_dir)


def _candidates(explicit: Any, job_dir: Any) -> List[Path]:
    dirs = []
    if explicit and "${" not in str(explicit):
        dirs.append(Path(str(explicit)).expanduser().resolve())
    dirs.append(Path(str(job_dir)))
    return dirs


# ---------------------------------------------------------------------------------------------------------------


def collect(sweep_dir: Path, earlier: Collection[Path] = ()) -> List[Dict[str, Any]]:
    """One row per job directory (a directory holding .hydra/overrides.yaml) under `sweep_dir`, in job order.
    `earlier` (resolved job directories): the jobs this run of the sweep skipped because they had finished before
    (commands/train.py says which: FINISHED_EARLIER), marked so in their rows whatever their files' times say."""

    rows = []
    for overrides_file in sorted(Path(sweep_dir).glob("*/.hydra/overrides.yaml")):
        job_dir = overrides_file.parent.parent
        overrides = yaml.safe_load(overrides_file.read_text(encoding="utf-8")) or []
        job_cfg_file = job_dir / ".hydra" / "config.yaml"
        job_cfg = yaml.safe_load(job_cfg_file.read_text(encoding="utf-8")) if job_cfg_file.is_file() else {}
        dirs = _candidates(((job_cfg or {}).get("trainer") or {}).get("output_dir"), job_dir)
        rows.append({"job": job_dir.name, "overrides": [str(o) for o in overrides], "run_dir": str(dirs[0]),
                     **read_run(*dirs), "earlier": job_dir.resolve() in earlier})  # fmt: skip
    rows.sort(key=lambda r: (not r["job"].isdigit(), int(r["job"]) if r["job"].isdigit() else 0, r["job"]))
    return rows


def refuse_other_jobs(sweep_dir: Path, jobs: List[List[str]]) -> None:
    """A sweep run again into `sweep_dir` (ours: claim_sweep_dir) runs job N in `<sweep_dir>/N`, where Hydra rewrites
    the job's record (.hydra/overrides.yaml, what the table shows) before the job starts. Job N of this run must be
    the job that is there: the same values of every swept key (those that differ between jobs, of this run or the
    earlier one); settings common to all jobs may change (each job's resume contract judges them: a larger
    trainer.max_steps trains every job further). Else a UserError, before Hydra writes anything."""
    earlier = {}
    for n in range(len(jobs)):
        file = Path(sweep_dir) / str(n) / ".hydra" / "overrides.yaml"
        if file.is_file():
            try:
                earlier[n] = [str(o) for o in yaml.safe_load(file.read_text(encoding="utf-8")) or []]
            except (OSError, ValueError, yaml.YAMLError) as exc:
                raise UserError(f"hydra.sweep.dir: {file} is unreadable ({type(exc).__name__}); it records what "
                                f"job {n} of the earlier sweep there ran; choose a new hydra.sweep.dir") from None
    keys = set(varying_keys([{"overrides": o} for o in earlier.values()]))
    keys |= set(varying_keys([{"overrides": o} for o in jobs]))
    values = lambda overrides: {k: v for k, _, v in (o.partition("=") for o in overrides) if k in keys}
    differ = [n for n, old in earlier.items() if values(old) != values(jobs[n])]
    if differ:
        n = differ[0]
        show = lambda overrides: " ".join(f"{k}={v}" for k, v in values(overrides).items()) or "(no swept value)"
        raise UserError(
            f"hydra.sweep.dir: {sweep_dir} holds an earlier sweep whose job {n} ran {show(earlier[n])}, but job {n} "
            f"of this one is {show(jobs[n])} ({len(differ)} of {len(jobs)} jobs differ); a job continues only in its "
            "own directory. Run that sweep's values again to resume it (a larger trainer.max_steps trains its jobs "
            "further), or choose a new hydra.sweep.dir for this sweep; nothing was changed")


def read_run(*dirs: Path) -> Dict[str, Any]:
    """The RESULT_KEYS of one run: result.json first, metrics.jsonl for numbers it lacks (first dir holding each)."""
    result: Dict[str, Any] = dict.fromkeys(RESULT_KEYS)
    result_file = _first(dirs, RESULT_FILE)
    if result_file is not None:
        try:
            recorded = json.loads(result_file.read_text(encoding="utf-8"))
            if not isinstance(recorded, dict):
                raise ValueError("not a JSON object")
            result.update(recorded)
        except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError too
            result.update(status="failed", error=f"unreadable {result_file}: {type(exc).__name__}: {str(exc)[:80]}")
    else:
        result.update(status="unknown", error=f"no {RESULT_FILE} (still running, or killed)")
    metrics_file = _first(dirs, METRICS_FILE)
    try:
        from_metrics = run_summary(metrics_file.parent) if metrics_file is not None else {}
        if metrics_file is not None:
            from_metrics.update(last_accuracy(read_metrics(metrics_file.parent)))
    except UserError as exc:  # a damaged metrics.jsonl: named in this run's row, the sweep table still prints
        from_metrics = {}
        result.update(status="failed", error=str(exc))
    for key in (*HEADLINE, "accuracy", "accuracy_key"):
        if result.get(key) is None:
            result[key] = from_metrics.get(key)
    return result


def last_accuracy(metrics: List[Dict[str, Any]]) -> Dict[str, Any]:
    """{"accuracy", "accuracy_key"} of the last evaluation that reports one of ACCURACY_KEYS (empty when none)."""
    for row in reversed(metrics):
        key = next((k for k in ACCURACY_KEYS if _finite(row.get(k))), None)
        if key is not None:
            return {"accuracy": float(row[key]), "accuracy_key": key}
    return {}


def _first(dirs: Any, name: str) -> Optional[Path]:
    return next((d / name for d in dirs if (d / name).is_file()), None)


def varying_keys(rows: List[Dict[str, Any]]) -> List[str]:
    """Override keys whose value differs between jobs (the swept ones), in first-seen order."""
    values: Dict[str, set] = {}
    for row in rows:
        for ov in row["overrides"]:
            key, _, value = ov.partition("=")
            values.setdefault(key, set()).add(value)
    per_job = [{ov.partition("=")[0] for ov in row["overrides"]} for row in rows]
    return [k for k, v in values.items() if len(v) > 1 or any(k not in keys for keys in per_job)]


def write_summary(sweep_dir: Path, earlier: Collection[Path] = ()) -> List[Dict[str, Any]]:
    rows = collect(sweep_dir, earlier)
    summary = {
        "sweep_dir": str(sweep_dir),
        "swept": varying_keys(rows),
        "jobs": rows,
        "ok": sum(r["status"] == "ok" for r in rows),
        "failed": sum(r["status"] == "failed" for r in rows),
        "earlier": sum(bool(r.get("earlier")) for r in rows),  # of those, finished before this run of the sweep
    }
    atomic_write_json(sweep_dir / SUMMARY_JSON, summary)
    picture = plot_summary(sweep_dir, rows)
    atomic_write_text(sweep_dir / SUMMARY_MD, render_markdown(rows) + "\n" + (
        f"\n![every job's train and eval loss]({SUMMARY_PNG})\n" if picture else ""))
    return rows


def plot_summary(sweep_dir: Path, rows: List[Dict[str, Any]]) -> bool:
    """summary.png: every job's loss curves on one set of axes, labelled by its swept values."""

    jobs = [(label, _curves(Path(row["run_dir"])) or _curves(sweep_dir / row["job"]))
            for label, row in zip(curve_labels(rows), rows)]
    return plot_sweep(jobs, sweep_dir / SUMMARY_PNG, title=f"sweep {sweep_dir.name}: {len(rows)} jobs")


def _curves(run_dir: Path) -> List[Dict[str, Any]]:
    """A job's metrics for the picture; a damaged file (named in its row of the table) draws no curve."""
    try:
        return read_metrics(run_dir)
    except UserError:
        return []


def curve_labels(rows: List[Dict[str, Any]]) -> List[str]:
    """Each job's swept values (`optimizer.lr=1e-3 zero=stage2`), or `job N` when nothing varies."""
    keys = varying_keys(rows)
    labels = []
    for row in rows:
        values = dict(ov.partition("=")[::2] for ov in row["overrides"])
        labels.append(" ".join(f"{k}={values[k]}" for k in keys if k in values) or f"job {row['job']}")
    return labels


METRICS = (("final_eval_loss", "eval loss"), ("final_loss", "final loss"))  # the sweep's metric: first one jobs have


def best_row(rows: List[Dict[str, Any]]) -> Optional[Tuple[int, str, str]]:
    """(index, key, name) of the job with the lowest eval loss (final train loss when no job evaluated) among the
    jobs that finished; None unless at least two of them have that number (one job is not "best" of anything)."""
    for key, name in METRICS:
        scored = [(float(r[key]), i) for i, r in enumerate(rows) if r["status"] == "ok" and _finite(r.get(key))]
        if len(scored) >= 2:
            return min(scored)[1], key, name
        if scored:
            return None
    return None


def render_markdown(rows: List[Dict[str, Any]]) -> str:
    keys = varying_keys(rows)
    best = best_row(rows)
    accuracy = sorted({r["accuracy_key"] for r in rows if r.get("accuracy_key")}, key=ACCURACY_KEYS.index)
    head = ["job", *keys, "status", "final loss", "eval loss", *(["/".join(accuracy)] if accuracy else []),
            "tokens/s", "peak MB", "error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(rows):
        ovs = dict(ov.partition("=")[::2] for ov in row["overrides"])
        error = (row.get("error") or "").replace("|", "\\|").replace("\n", " ")
        numbers = {"final_loss": _num(row["final_loss"], 4), "final_eval_loss": _num(row["final_eval_loss"], 4)}
        job = row["job"]
        if best is not None and best[0] == i:
            job, numbers[best[1]] = f"{job} (best)", f"**{numbers[best[1]]}**"
        acc = [_num(row.get("accuracy"), 4)] if accuracy else []
        status = f"{row['status']} (earlier)" if row.get("earlier") else str(row["status"])
        cells = [job, *[ovs.get(k, "") for k in keys], status, numbers["final_loss"],
                 numbers["final_eval_loss"], *acc, _num(row["tokens_per_s"], 1), _num(row["peak_mem_mb"], 0),
                 error[:120]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if best is not None:
        label = " ".join(o for o in rows[best[0]]["overrides"] if o.partition("=")[0] in keys)
        lines.append(f"\nbest by {best[2]} (lowest): job {rows[best[0]]['job']}" + (f" ({label})" if label else ""))
    earlier = [r["job"] for r in rows if r.get("earlier")]
    if earlier:
        lines.append(f"\n(earlier) = finished before this run of the sweep and not run again, its numbers from then: "
                     f"job{'s' if len(earlier) > 1 else ''} {', '.join(earlier)}")
    return "\n".join(lines)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _num(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{float(value):.{digits}f}"
