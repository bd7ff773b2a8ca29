"""Run a pipeline's stages in order (`dsrecipes pipeline FILE`), each one a normal run directory, resumable anywhere.

    <out>/dsrecipes_pipeline.json    our marker (the directory is claimed before anything is written into it)
    <out>/pipeline_state.json        per stage: status (running | done | failed | interrupted), its train overrides,
                                     run directory, export, exit code; rewritten atomically after every change
    <out>/<stage>/                   the stage's run directory (trainer.output_dir and hydra.run.dir)
    <out>/pipeline_summary.md, .png  the stages side by side (observe/pipeline_report.py)

Each stage is `train` with the stage's overrides (config/pipeline_file.py) plus `trainer.output_dir` and, under
`model_from`, `model.path=<that stage's export>` (under `from_export: {KEY: STAGE}`, KEY=<that stage's export>: a
reward model for an RL stage); the caller supplies `train` (the command's own entry, in this
process), so a stage has every guarantee of a run started by hand. Before the first stage every stage's
composition is loaded and validated (model paths of later stages are not there yet, so files are not checked):
a typo in the last stage stops the pipeline before the first step.

Resume is the same command: a stage recorded done is never run again (its overrides must be the ones recorded, or
the pipeline is refused: a finished stage cannot be changed, use a new --out); a stage whose run finished while
the record was not yet written (killed between stages) is recorded done from its result.json; any other stage is
started again with the same overrides and run directory, so `train` resumes it from its newest checkpoint
(trainer.resume=auto). A stage that fails stops the pipeline with one message naming the stage, its cause (the
stage's run says it to the pipeline, not the console: StageFailed), its run directory and the resume command (exit
2); a stage that crashes (an exception that is no refusal: a bug, a torch error in this process) is said the same way,
as 'Type: message (at file:line)', its traceback kept in <out>/<stage>/logs/main.log (<out>/logs/pipeline.log when
the stage made no run directory), never on the console; an interrupted stage (Ctrl-C, SIGTERM) ends it with the run's exit code.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import dsrecipes.core.stopping as stopping
from dsrecipes.config.load import compose_and_load
from dsrecipes.config.pipeline_file import Pipeline, Stage, outside_by_hand, stage_overrides
from dsrecipes.config.safety import (
    OUTSIDE_OPTIONS,
    SIGNED_BUCKETS_ENV,
    STORE_FIELDS,
    foreign_buckets,
    outside_option_places,
    registry_buckets,
    related,
)
from dsrecipes.core.console import LOGS_DIR, log_path
from dsrecipes.core.errors import UserError
from dsrecipes.core.export_dir import EXPORT_DIR
from dsrecipes.core.failure import log_traceback, one_line
from dsrecipes.core.fileio import atomic_write_json
from dsrecipes.core.locks import ExclusiveLock, LockHeld
from dsrecipes.core.rundir import FOREIGN_REMEDY, RESULT_FILE, claim_marked_dir
from dsrecipes.observe.pipeline_report import write_summary
from dsrecipes.run.resume_contract import RESUME_REMEDY

MARKER = "dsrecipes_pipeline.json"
STATE_FILE = "pipeline_state.json"
LOCK_FILE = ".dsrecipes.pipeline.lock"
INTERRUPTED = (130, 143)  # the exit codes of a run stopped by SIGINT / SIGTERM
Train = Callable[[List[str]], int]  # a stage's exit code, or StageFailed


class StageFailed(Exception):
    """A stage's run failed (exit `code`), and why: its messages (`causes`), said by the pipeline with the stage; or
    it crashed (`crash`: an exception that is no user error, e.g. a bug): its one line is said, its traceback goes to
    the stage's log (stage_log), never to the console."""

    def __init__(self, code: int, causes: List[str], crash: Optional[BaseException] = None):
        super().__init__(f"exit {code}: {'; '.join(causes) or crash!r}")
        self.code, self.causes, self.crash = code, causes, crash


@dataclass
class PipelineRun:
    pipeline: Pipeline
    out: Path
    resume_command: str
    state: Dict[str, Any]

    def record(self, stage: Stage, **fields: Any) -> None:
        self.state["stages"].setdefault(stage.name, {}).update(fields)
        atomic_write_json(self.out / STATE_FILE, self.state)

    def entry(self, name: str) -> Dict[str, Any]:
        return self.state["stages"].get(name, {})


def run_pipeline(pipeline: Pipeline, out: Path, train: Train, resume_command: str) -> int:
    """Every stage in order (see the module's opening comment); returns 0, or an interrupted stage's exit code."""
    check_stages(pipeline, out)
    claim_marked_dir(out, "--out", MARKER, "a dsrecipes pipeline directory")
    with _held(out):
        run = PipelineRun(pipeline, out, resume_command, read_state(out, pipeline))
        started = time.perf_counter()
        stopping.reset()  # set only inside a stage's run (stopping.handling); a stage's launch resets it too
        for number, stage in enumerate(pipeline.stages, 1):
            try:
                code = run_stage(run, stage, number, train)
            except KeyboardInterrupt:
                said_interrupted(run, stage, number)
                raise
            if code:
                return code
            signum = stopping.requested()  # it came at the stage's last step (that run ends there, exported)
            if signum is not None and number < len(pipeline.stages):
                print(f"pipeline: stage {stage.name!r} ({number} of {len(pipeline.stages)}) finished; "
                      f"{signal.Signals(signum).name} came meanwhile, so the pipeline stops before stage "
                      f"{pipeline.stages[number].name!r}; resume with: {resume_command}", file=sys.stderr, flush=True)
                return stopping.exit_code(signum)
    print(write_summary(out, [(s.name, out / s.name) for s in pipeline.stages], time.perf_counter() - started),
          flush=True)
    return 0


@contextlib.contextmanager
def _held(out: Path) -> Iterator[None]:
    """One pipeline at a time in a directory (two would race for the state file and the stages' runs)."""
    lock = ExclusiveLock(out / LOCK_FILE, {"pipeline_dir": str(out)})
    try:
        lock.acquire()
    except LockHeld as exc:
        raise UserError(f"--out: {out} is in use by another pipeline: {exc.holder}. Wait for it, stop it, or "
                        "choose another --out") from None
    try:
        yield
    finally:
        lock.release()


def stage_argv(pipeline: Pipeline, stage: Stage, out: Path) -> List[str]:
    """The overrides `train` gets for `stage` (the same on every resume)."""
    argv = stage_overrides(pipeline, stage)
    argv += [f"{key}={out.resolve() / source / EXPORT_DIR}" for key, source in stage.exports_used().items()]
    run_dir = out.resolve() / stage.name
    return argv + [f"trainer.output_dir={run_dir}", f"hydra.run.dir={run_dir}"]


def check_stages(pipeline: Pipeline, out: Path) -> None:
    """Every stage's composition loads and validates (files are checked when the stage starts); a stage another
    one takes its model from must export one."""
    problems: List[str] = []
    kinds: Dict[str, str] = {}  # stage -> its objective
    splits: Dict[str, Any] = {}  # stage -> its dataset.split
    for stage in pipeline.stages:
        if stage.name == LOGS_DIR:  # DIR/logs/ holds the pipeline's own logs (a crash's, the prompt answers')
            problems.append(f"stage {stage.name!r} (line {stage.line}): the name of the pipeline's own folder "
                            f"{out / LOGS_DIR}; name the stage otherwise")
        try:
            cfg = compose_and_load(stage_argv(pipeline, stage, out), check_files=False)
        except UserError as exc:
            problems += [f"stage {stage.name!r} (line {stage.line}): {p}" for p in exc.problems]
            continue
        kinds[stage.name] = getattr(cfg.objective.kind, "value", str(cfg.objective.kind))
        if cfg.model.lora.enabled and not cfg.trainer.export_merged_lora:  # its export: an adapter, not a scorer
            kinds[stage.name] += " with trainer.export_merged_lora=false (its export is an adapter only)"
        problems += split_conflicts(pipeline, stage, cfg.dataset.split, splits)
        problems += [f"stage {stage.name!r} (line {stage.line}): {p}" for p in outside_options(cfg, pipeline, stage)]
        scorer = stage.from_export.get("objective.reward_model")  # the export is not there yet: its stage's objective
        if scorer in kinds and kinds[scorer] != "reward":
            problems.append(f"stage {stage.name!r} (line {stage.line}): from_export objective.reward_model: stage "
                            f"{scorer!r} trains objective={kinds[scorer]}, not a reward model (objective=reward"
                            f"{', exported merged' if kinds[scorer].startswith('reward') else ''})")
        takers = [s.name for s in pipeline.stages if stage.name in s.exports_used().values()]
        if takers and not cfg.trainer.export:
            problems.append(f"stage {stage.name!r} (line {stage.line}): trainer.export is false, but stage "
                            f"{takers[0]!r} takes this stage's export")
    if problems:
        raise UserError([f"{pipeline.path}: {p}" for p in problems])


def split_conflicts(pipeline: Pipeline, stage: Stage, split: Any, splits: Dict[str, Any]) -> List[str]:
    """A stage's `dataset.split` against the earlier stages' (`splits`, which this adds it to). Shares are dealt by
    the weights of all of them, so two stages that name a share in common but weigh or pin them differently read
    overlapping rows (DeepSpeed-Chat's --data_split is one for all three steps); and an RL stage scored by a reward
    stage's export must not take the share that reward model trained on (it would score prompts it was fit to)."""
    found, at = [], f"stage {stage.name!r} (line {stage.line})"
    shares, pin = dict(split.shares), dict(split.pin)
    for name, other in splits.items():
        if set(shares) & set(other.shares) and (shares, pin) != (dict(other.shares), dict(other.pin)):
            key = "dataset.split.shares" if shares != dict(other.shares) else "dataset.split.pin"
            mine, theirs = (shares, dict(other.shares)) if key.endswith("shares") else (pin, dict(other.pin))
            found.append(f"{at}: {key}={_flow(mine)} differs from stage {name!r}'s {_flow(theirs)}; stages that "
                         "split the same shares must split them the same way, or one stage reads rows of another's "
                         "share: set dataset.split.shares (and pin) once, under shared:")
    scorer = splits.get(stage.from_export.get("objective.reward_model", ""))
    if scorer is not None and shares and split.take is not None and split.take == scorer.take:
        found.append(f"{at}: dataset.split.take={split.take} is the share its reward model (from_export "
                     f"objective.reward_model: {stage.from_export['objective.reward_model']}) was trained on; take "
                     "another share of dataset.split.shares, so the reward model scores prompts it did not train on")
    splits[stage.name] = split
    return found


def _flow(mapping: Dict[str, Any]) -> str:
    return "{" + ",".join(f"{k}:{v}" for k, v in sorted(mapping.items())) + "}"


def outside_options(cfg: Any, pipeline: Pipeline, stage: Stage) -> List[str]:
    """A stage's OUTSIDE_OPTIONS and store buckets (config/safety.py) as its composition resolved them: the pipeline file and the stage's
    recipe are shared, and an element like `${trainer.experiment}` is text naming no option that resolves to one
    (config/pipeline_file.py judges the settings' text; this, what train will run). Said as config/safety says a
    shared recipe's, naming where the key was set (`set_by`); a pipeline takes no overrides, so an option only a
    command line may name means running that stage by hand."""
    found, at = [], functools.partial(set_by, pipeline, stage)
    for path in OUTSIDE_OPTIONS:
        value, key = functools.reduce(getattr, path, cfg), ".".join(path)
        found += [f"{key}[{i}]: {str(value[i]).partition('=')[0]} set by {at(key)}; it {outside_by_hand(key)}"
                  for i in outside_option_places(path, value)]
    for path in STORE_FIELDS:  # the user's AWS credentials sign every request to a bucket (config/safety.py)
        value, key = functools.reduce(getattr, path, cfg), ".".join(path)
        buckets = foreign_buckets([s.paths for s in value] if path == ("dataset", "sources") else value)
        found += [f"{key}: s3://{buckets[0]}/... set by {at(key)}; {_SIGNED}, so allow the bucket: "
                  f"{SIGNED_BUCKETS_ENV}={','.join(buckets)}"] if buckets else []
    found += [f"dataset.registry: entry {name!r} reads s3://{buckets[0]}/... (registry {cfg.dataset.registry}, set by "
              f"{at('dataset.registry')}); {_SIGNED}, so allow the bucket: {SIGNED_BUCKETS_ENV}={','.join(buckets)}"
              for name, buckets in registry_buckets(cfg.dataset.registry, list(cfg.dataset.use))]
    return found


_SIGNED = ("reading it would sign requests to that bucket with your AWS credentials (its owner's logs see your access "
           "key id)")


def set_by(pipeline: Pipeline, stage: Stage, key: str) -> str:
    """Where the pipeline file sets `key` (its last setting that reaches it: the stage's own after `shared`; a group
    choice reaches the keys below it), as 'FILE:LINE, a pipeline file (shared like a recipe)'; the stage's recipe
    where no setting does."""
    hits = [s for s in pipeline.shared + stage.settings if related(tuple(key.split(".")), tuple(s.key.split(".")))]
    if hits or not stage.recipe:
        return f"{pipeline.path}{f':{hits[-1].line}' if hits else ''}, a pipeline file (shared like a recipe)"
    return f"recipe {stage.recipe} (stage {stage.name!r}'s, shared)"


def read_state(out: Path, pipeline: Pipeline) -> Dict[str, Any]:
    path = out / STATE_FILE
    if not path.exists():
        return {"pipeline": str(pipeline.path.resolve()), "stages": {}}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(state, dict) and isinstance(state.get("stages"), dict)
        assert all(_entry_shaped(entry) for entry in state["stages"].values())
    except (OSError, ValueError, AssertionError, RecursionError):
        raise UserError(f"--out: {path} is not a pipeline state this program wrote; choose another --out") from None
    return state


def _entry_shaped(entry: Any) -> bool:
    """A stage's record as run_stage writes it (was: any JSON, so an edited or damaged state file crashed the
    pipeline with 'a bug in dsrecipes' instead of this message)."""
    texts = ("status", "run_dir", "export")
    return (isinstance(entry, dict) and all(isinstance(entry.get(k, ""), str) for k in texts)
            and (entry.get("argv") is None or isinstance(entry["argv"], list) and all(isinstance(a, str) for a in entry["argv"]))
            and isinstance(entry.get("exit_code", 0), int))


def run_stage(run: PipelineRun, stage: Stage, number: int, train: Train) -> int:
    argv = stage_argv(run.pipeline, stage, run.out)
    entry, of = run.entry(stage.name), f"stage {stage.name!r} ({number} of {len(run.pipeline.stages)})"
    if entry.get("argv") not in (None, argv) and entry.get("status") == "done":
        raise UserError(f"{run.pipeline.path}: {of} finished with other settings than the file now gives it "
                        f"({changed(entry['argv'], argv)}); a finished stage is never run again: restore its "
                        "settings, or start over with a new --out")
    before = entry.get("argv")  # the settings the stage last started with (a resumed run continues under them)
    if entry.get("status") == "done" or (entry.get("argv") == argv and finished(run.out / stage.name)):
        run.record(stage, status="done", argv=argv, run_dir=str(run.out / stage.name), exit_code=0,
                   export=str(run.out / stage.name / EXPORT_DIR))
        print(f"pipeline: {of} is done ({run.out / stage.name}); not run again", flush=True)
        return 0
    again = " (resumed: the run continues from its newest checkpoint)" if entry else ""
    print(f"pipeline: {of}{again}: dsrecipes train {' '.join(argv)}", flush=True)
    if before not in (None, argv):  # the file was edited since: said, not silently continued under other settings
        print(f"pipeline: {of} was started with other settings than {run.pipeline.path} now gives it "
              f"({changed(before, argv)}); its run continues under the file's where its checkpoint allows (train "
              "refuses the others: then restore them, or start over with a new --out)", file=sys.stderr, flush=True)
    run.record(stage, status="running", argv=argv, run_dir=str(run.out / stage.name))
    causes: List[str] = []
    try:
        with remedies(run.pipeline.path, edited=before not in (None, argv)):
            code = train(argv)
    except StageFailed as exc:
        code, causes = exc.code, exc.causes + ([crashed(run.out, stage, exc.crash)] if exc.crash else [])
    if code in INTERRUPTED:
        run.record(stage, status="interrupted", exit_code=code)
        print(f"pipeline: {of} was interrupted; resume with: {run.resume_command}", file=sys.stderr, flush=True)
        return code
    if code:
        run.record(stage, status="failed", exit_code=code)
        why = f": {'; '.join(c.removeprefix('error: ') for c in causes)}" if causes else ""
        where = f"its run directory: {run.out / stage.name}" if (run.out / stage.name).is_dir() else "it wrote nothing"
        since = (f"; it was started with other settings ({changed(before, argv)}): restore them in "
                 f"{run.pipeline.path}, {OWN_DIR}") if before not in (None, argv) else ""
        raise UserError(f"pipeline: {of} failed (exit {code}){why}{since}; {where}; the stages before it are kept. "
                        f"Fix the cause, then resume with: {run.resume_command}")
    run.record(stage, status="done", exit_code=0, export=str(run.out / stage.name / EXPORT_DIR))
    return 0


OWN_DIR = "or start over with a new --out (a stage's trainer.output_dir is the pipeline's)"


@contextlib.contextmanager
def remedies(path: Path, edited: bool) -> Iterator[None]:
    """A stage's refusals name the pipeline's remedy, not train's, where they are raised (a stage chooses neither
    its directory nor its trainer.output_dir): a stage directory with files of someone else's (core/rundir.py), a
    checkpoint that cannot resume under the stage's settings (run/resume_contract.py; the file `edited` since the
    stage started: the stage's failure line says how, `run_stage`)."""
    restore = "" if edited else f"; restore the stage's settings in {path}, {OWN_DIR}"
    foreign = FOREIGN_REMEDY.set("Move those files out of it, or start over with a new --out; nothing was changed")
    resume = RESUME_REMEDY.set(f"(nothing was changed){restore}")
    try:
        yield
    finally:
        RESUME_REMEDY.reset(resume)
        FOREIGN_REMEDY.reset(foreign)


def said_interrupted(run: PipelineRun, stage: Stage, number: int) -> None:
    """Ctrl-C or SIGTERM raised in the pipeline's own code (a stage's run returns 130/143 instead): in the stage's
    run, or between stages; the resume command is said either way (was: a bare 'interrupted' between stages)."""
    of = f"stage {stage.name!r} ({number} of {len(run.pipeline.stages)})"
    if run.entry(stage.name).get("status") == "done":
        print(f"pipeline: interrupted after {of} finished; resume with: {run.resume_command}", file=sys.stderr,
              flush=True)
        return
    run.record(stage, status="interrupted")  # a run that ended meanwhile is recorded done on resume (finished())
    print(f"pipeline: {of} was interrupted; resume with: {run.resume_command}", file=sys.stderr, flush=True)


def changed(old: List[str], new: List[str]) -> str:
    """The keys whose override differs between two argv of a stage, 'KEY: OLD -> NEW' (the last override of a key
    wins, as in train; '-' where a key is not set)."""
    def keyed(argv: List[str]) -> Dict[str, str]:
        return {k.lstrip("+"): v for k, _, v in (a.partition("=") for a in argv)}

    was, now = keyed(old), keyed(new)
    keys = [k for k in dict.fromkeys([*was, *now]) if was.get(k) != now.get(k)]
    return ", ".join(f"{k}: {was.get(k, '-')} -> {now.get(k, '-')}" for k in keys)


def stage_log(out: Path, stage: Stage) -> Path:
    """Where a stage's crash is written: its run directory's log of the launching process (core/console.log_path),
    or the pipeline's own log where the stage made no run directory (nothing is written into one it did not claim)."""
    run_dir = out / stage.name
    return log_path(run_dir, "main") if run_dir.is_dir() else log_path(out, "pipeline")


def crashed(out: Path, stage: Stage, exc: BaseException) -> str:
    """A crash's one line (core/failure.one_line: 'Type: message (at file:line)') and where its traceback was kept."""
    log = stage_log(out, stage)
    log_traceback(log, exc)
    return f"{one_line(exc)} (full traceback: {log})"


def finished(run_dir: Path) -> bool:
    """Whether a run directory's result.json says it ended well (a stage killed before its record was written)."""
    try:
        result = json.loads((run_dir / RESULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and result.get("status") == "ok" and result.get("exit_code") == 0
