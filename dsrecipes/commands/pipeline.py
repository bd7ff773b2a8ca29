"""`dsrecipes pipeline PIPELINE.yaml [--out DIR]`: run a pipeline's stages in order (run/pipeline.py), each one
through the training command's own entry in this process; the same command resumes it (default --out:
runs/<file name without .yaml>)."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import List, Sequence

import dsrecipes.boundary.trust as trust
import dsrecipes.commands.outcome as outcome
import dsrecipes.commands.train as train
import dsrecipes.core.stopping as stopping
from dsrecipes.commands.args import command_parser, existing_path, parse
from dsrecipes.config.pipeline_file import Pipeline, load_pipeline
from dsrecipes.core.console import log_path, quiet_third_party
from dsrecipes.core.errors import UserError
from dsrecipes.core.paths import shipped_recipes_dir
from dsrecipes.core.suggest import closest, phrase
from dsrecipes.run.pipeline import StageFailed, run_pipeline


def main(argv: List[str]) -> int:
    parser = command_parser("pipeline", "run a pipeline's stages in order (SFT -> reward -> DPO, ...), resumably")
    parser.add_argument("file", help="the pipeline file (recipes/pipelines/*.yaml)")
    parser.add_argument("--out", default=None, help="the pipeline's directory (default: runs/<file name>)")
    parser.add_argument(trust.FLAG, action="append", default=[], type=existing_path, metavar="PATH",
                        help=f"{trust.TRUST_HELP}; for every stage of this command (e.g. a reward model someone else wrote)")
    args = parse(parser, argv)
    path = pipeline_file(args.file)
    pipeline = load_pipeline(path)
    out = Path(args.out) if args.out else Path("runs") / path.stem
    command = resume_command(path, out, args.trust_checkpoint)
    code = run_pipeline(pipeline, out, lambda a: train_stage(a, command, args.trust_checkpoint), command)
    if code == 0 and pipeline.prompts is not None:  # not after a signal that came in the last stage's last step
        print(prompt_answers(pipeline, out) if stopping.requested() is None else "prompt answers skipped: "
              f"{signal.Signals(stopping.requested()).name} came while the last stage ended", flush=True)
    return code


def pipeline_file(arg: str) -> Path:
    """ARG as given, else a shipped pipeline by its name (`smollm2_chat`) or by the checkout's path to it
    (`recipes/pipelines/smollm2_chat.yaml`, run from another directory or an installed package)."""
    path, shipped = Path(arg), shipped_recipes_dir() / "pipelines"
    if path.exists() or path.suffix not in ("", ".yaml") or str(path.parent) not in (".", "recipes/pipelines"):
        return path
    if (shipped / f"{path.stem}.yaml").is_file():
        return shipped / f"{path.stem}.yaml"
    names = sorted(p.stem for p in shipped.glob("*.yaml"))
    raise UserError(f"{arg}: no such pipeline file{phrase(closest(path.stem, names))} (shipped pipelines, run by "
                    f"name: {', '.join(names)})")


def prompt_answers(pipeline: Pipeline, out: Path) -> str:
    """The base model and every generating stage on the same held-out prompts (serve/pipeline_prompts.py); a
    pipeline whose stages all finished is not failed by them: a reason they cannot be asked is printed instead."""
    from dsrecipes.serve.pipeline_prompts import answer_stages  # lazy: else `commands.pipeline` imports torch

    # a stage quiets third-party noise into its run's log; a pipeline whose stages all finished runs none, and the
    # models' "Loading weights" bars came to the console. Here: the pipeline's own logs/ (DIR/logs/prompts.log)
    quiet_third_party(log_path(out, "prompts"))
    try:
        return answer_stages(out, [(s.name, out / s.name) for s in pipeline.stages], pipeline.prompts.limit,
                             pipeline.prompts.max_new_tokens)
    except UserError as exc:
        return f"prompt answers skipped: {exc.render().removeprefix('error: ')}"


def resume_command(path: Path, out: Path, trusted: Sequence[str] = ()) -> str:
    """This pipeline again, from where it was started (its file and --out may be relative), as the training command's
    own resume command is written (commands/outcome.py); with this command line's --trust-checkpoint PATHs (absolute),
    which a resumed stage needs again."""
    args = [sys.executable, "-m", "dsrecipes", "pipeline", str(path), "--out", str(out)]
    args += [a for p in trusted for a in (trust.FLAG, str(Path(p).expanduser().resolve()))]
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join(args)}"


def train_stage(argv: List[str], resume: str, trusted: Sequence[str] = ()) -> int:
    """One stage as `dsrecipes train ARGV` runs (cli.py's handling: a refusal is one message and its exit code). An
    interrupted or failed stage names no resume command of its own: the pipeline's (`resume`) is said once; a failed
    stage's cause is said with it, once (StageFailed: run/pipeline.py). `trusted`: the pipeline's --trust-checkpoint
    PATHs, given to each stage as its own command line's; a refusal of an input names the pipeline to repeat."""
    trust.reset()  # what a stage relied on or accepted is never carried to the next: each starts from the flags
    trust.trust(list(trusted), resume)
    causes: List[str] = []
    resumed_by, kept = outcome.RESUMED_BY.set(resume), outcome.CAUSES.set(causes)
    try:
        code = train.main(argv)
    except UserError as exc:
        raise StageFailed(exc.exit_code, exc.problems) from None
    except Exception as exc:  # noqa: BLE001 - a crash of one stage (train re-raises it for a single run): the
        raise StageFailed(1, [], crash=exc) from None  # pipeline says its line, keeps its traceback (run/pipeline.py)
    finally:
        outcome.RESUMED_BY.reset(resumed_by)
        outcome.CAUSES.reset(kept)
    if code and causes:
        raise StageFailed(code, causes)
    return code
