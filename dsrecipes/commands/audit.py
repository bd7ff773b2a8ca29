"""`dsrecipes audit [overrides] --world-size N --num-workers W --epochs E`: prove a data plan, or check a run's
ledgers (`--ledger RUN`: the training ledger, and the evaluation ledger when the run recorded evaluations; a
pipeline's directory: every stage and the shares they took, audit_pipeline.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional, Set

from dsrecipes.commands.args import bounded_int, existing_dir, non_negative_int, override_parser, parse
from dsrecipes.commands.audit_pipeline import audit_pipeline, is_pipeline_dir
from dsrecipes.config.load import compose_and_load
from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import read_json_file
from dsrecipes.core.rundir import RESULT_FILE
from dsrecipes.core.topology import resolve_topology
from dsrecipes.data.plan.eval_ledger import EVAL_LEDGER_PREFIX, check_eval_ledgers, eval_ledger_files
from dsrecipes.data.plan.ledger import LEDGER_DIR, verify_ledgers
from dsrecipes.run.micro_batch import needs_number

MAX_WORLD_SIZE = 16384  # audit simulates each rank: beyond this it would run for minutes
MAX_EPOCHS = 1000
MAX_NUM_ROWS = 100_000_000  # audit permutes every row index (8 bytes each) per epoch: 0.8 GB at this bound
MAX_ROW_EPOCHS = 200_000_000  # --num-rows x --epochs: ~1 s per 10^6 row-epochs on one core, so at most minutes
MAX_RANK_EPOCHS = 2_000_000  # --world-size x --epochs: 16384 x 122 took 26 s (the sample dataset, 2 cores)


def main(argv: List[str]) -> int:
    from dsrecipes.data.strategies import audit_config  # lazy: else `commands.audit` imports numpy 0.11 s
    from dsrecipes.data.strategies.split_audit import audit_split  # lazy: the same package

    parser = override_parser("audit", "prove exactly-once / equal-steps data plans for a world size")
    parser.add_argument("--world-size", type=bounded_int(MAX_WORLD_SIZE, "audit simulates every rank"),
                        default=None,
                        help="data-parallel ranks (default: the launcher's)")
    parser.add_argument("--num-workers", type=non_negative_int, default=None,
                        help="DataLoader workers per rank (default: data.num_workers)")
    parser.add_argument("--epochs", type=bounded_int(MAX_EPOCHS, "audit plans every epoch"), default=2,
                        help="epochs to check (default 2)")
    parser.add_argument("--num-rows", type=bounded_int(MAX_NUM_ROWS, "audit permutes every row index"), default=None,
                        help="map: audit this many rows instead of preparing")
    parser.add_argument("--ledger", type=existing_dir, default=None, metavar="RUN_DIR",
                        help="check a finished run's ledger instead (a pipeline's --out: every stage, and the "
                             "dataset.split shares its stages took)")
    parser.add_argument("--verbose", action="store_true", help="print every rank")
    args = parse(parser, argv)
    overrides = list(args.overrides)
    if args.num_workers is not None:
        overrides.append(f"data.num_workers={args.num_workers}")
    if args.ledger:
        run = Path(args.ledger)
        return audit_pipeline(run, audit_ledgers) if is_pipeline_dir(run) else audit_ledgers(run)
    if args.num_rows and args.num_rows * args.epochs > MAX_ROW_EPOCHS:
        raise UserError(f"--num-rows {args.num_rows} x --epochs {args.epochs}: more than {MAX_ROW_EPOCHS:,} row-epochs "
                        "to simulate (minutes per 10^8); audit fewer epochs or rows")
    cfg = compose_and_load(overrides)
    needs_number(cfg, "audit the data plan")
    world = args.world_size if args.world_size is not None else resolve_topology(cfg.launcher).world_size
    if world * args.epochs > MAX_RANK_EPOCHS:  # 16384 ranks x 1000 epochs: no line after 60 s (~2.5 min)
        raise UserError(f"--world-size {world} x --epochs {args.epochs}: more than {MAX_RANK_EPOCHS:,} rank-epochs "
                        "to simulate (half a minute per 2*10^6); audit fewer epochs (every epoch is planned alike)")
    split_ok = True
    if cfg.dataset.split.shares:  # the shares of dataset.split first: disjoint and covering
        split = audit_split(cfg.dataset, cfg)
        print(split.render())
        split_ok = split.ok
    report = audit_config(cfg, world, args.epochs, args.num_rows)
    print(report.render(args.verbose))
    return 0 if report.ok and split_ok else 1


def audit_ledgers(run: Path) -> int:
    """The training ledger (every sample once per epoch, equal steps) and, when the run recorded evaluations, the
    evaluation ledger (each evaluation scored the same samples, each once across ranks): 1 when either fails."""
    check_ledger_files(run)
    ledger = verify_ledgers(run)
    if not any(ledger.steps_per_rank.values()) and not eval_ledger_files(run) and not run_steps(run):
        raise UserError(trained_no_step(run))  # a run stopped before step 1: nothing to check is no OK either
    unrecorded = unrecorded_steps(run, ledger.step_numbers)
    if unrecorded:
        ledger.problems.append(unrecorded)
    print(ledger.summary())
    if not eval_ledger_files(run):
        print("evaluation ledger: none (the run recorded no evaluation), not checked")
        return 0 if ledger.ok else 1
    evaluations = check_eval_ledgers(run)
    print(evaluations.summary())
    return 0 if ledger.ok and evaluations.ok else 1


def unrecorded_steps(run: Path, recorded: Set[int]) -> Optional[str]:
    """The steps the run's result.json says it trained and its ledger does not list (a resume with
    trainer.record_samples=false, or one that turned it on): the audit cannot vouch for them, so they are a problem,
    not an OK. None when every step is recorded, or when there is no readable result (a run still going, killed)."""
    steps = run_steps(run)
    if not steps:
        return None
    missing = sorted(set(range(1, steps + 1)) - recorded)
    if not missing:
        return None
    return (f"{run / RESULT_FILE}: the run trained {steps} steps, its ledger lists {steps - len(missing)}: "
            f"{len(missing)} step(s) ({missing[0]}..{missing[-1]}) are not in it and not checked (trained without "
            "trainer.record_samples=true, or in the run directory of trainer.resume_from); to audit a whole run, "
            "record every session of it in one run directory")


def run_result(run: Path) -> dict:
    """The run's result.json ({} when there is none that reads: a run still going, killed, not a run)."""
    try:  # a run directory audit did not write: bounded, never waited on
        result = read_json_file(run / RESULT_FILE, "JSON nested too deeply")
    except (OSError, ValueError):
        return {}
    return result if isinstance(result, dict) else {}


def run_steps(run: Path) -> Optional[int]:
    """The steps the run's result.json says it trained; None when it says none that counts."""
    steps = run_result(run).get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps <= 10**9:
        return None
    return steps


def trained_no_step(run: Path) -> str:
    """What `--ledger` says of a run that trained no step (stopped before step 1, or not yet at it): its ledger lists
    the steps it trains, so there is nothing to audit; not the 'give a run trained with record_samples' of a wrong
    directory. Was: 'holds no ledger/ directory' for a run with trainer.record_samples=true stopped by SIGTERM."""
    result = run_result(run)
    how = result.get("error") if isinstance(result.get("error"), str) else result.get("status")
    how = " ".join(str(how).split())[:200] if how is not None else None  # one line: a multi-problem error has more
    said = (f" ({run / RESULT_FILE}: {how}, 0 steps)" if how is not None and run_steps(run) == 0
            else " (it has no result.json yet: still going, or killed)")
    return (f"--ledger: {run} trained no step{said}: nothing to audit; a run's ledger lists the steps it trained "
            "(resume the run, then audit it)")


def check_ledger_files(run: Path) -> None:
    """What verify_ledgers and check_eval_ledgers read is rank<N>.jsonl and eval_rank<N>.jsonl regular files: a FIFO
    there blocked the audit for ever, and `rankX.jsonl` was int()'s ValueError traceback."""
    ledger = run / LEDGER_DIR
    if not ledger.is_dir() and run_steps(run) == 0:  # stopped before step 1, ledger or not: nothing to check
        raise UserError(trained_no_step(run))
    if not ledger.is_dir():  # nothing to check is a wrong directory, not a violation
        raise UserError(f"--ledger: {run} holds no {LEDGER_DIR}/ directory; give the run directory of a run trained "
                        "with trainer.record_samples=true")
    for path in sorted(ledger.glob("rank*.jsonl")) + eval_ledger_files(run):
        prefix = EVAL_LEDGER_PREFIX if path.name.startswith(EVAL_LEDGER_PREFIX) else "rank"
        if not re.fullmatch(prefix + r"\d+\.jsonl", path.name):
            raise UserError(f"--ledger: {path} is not a rank's ledger ({prefix}<N>.jsonl, N a rank); move it out of "
                            f"{ledger}")
        if not path.is_file():
            raise UserError(f"--ledger: {path} is not a regular file (a FIFO, socket, device or directory); a rank's "
                            "ledger is a file the run wrote")
