"""`dsrecipes validate [--all] [overrides]`: compose + schema + rules, without importing torch."""

from __future__ import annotations

import sys
import time
from typing import List, Tuple

from dsrecipes.commands.args import override_parser, parse
from dsrecipes.config.defaults import config_warnings, model_name
from dsrecipes.config.groups import RECIPE_GROUP, group_options, recipes
from dsrecipes.config.load import check_composition, compose, compose_and_load, hydra_context
from dsrecipes.errors import ConfigError


def main(argv: List[str]) -> int:
    parser = override_parser("validate", "Validate one composition, or every recipe x every group option (--all).")
    parser.add_argument("--all", action="store_true", help="every recipe x every option of every group")
    parser.add_argument("--verbose", action="store_true", help="--all: list every combination the rules reject")
    args = parse(parser, argv)
    if args.all:
        return validate_all(args.overrides, verbose=args.verbose)
    cfg = compose_and_load(args.overrides)
    for warning in config_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"OK: data={cfg.data.kind.value} dataset={cfg.dataset.name} model={model_name(cfg)} "
        f"zero={cfg.zero.stage} offload={cfg.offload.label} precision={cfg.precision.dtype.value} "
        f"launcher={cfg.launcher.kind.value}"
    )
    return 0


def validate_all(extra: List[str], *, verbose: bool = False) -> int:
    """Each recipe must validate on its own; each group option, composed onto each recipe, must pass the schema.

    Combinations that the cross-field rules reject (e.g. offload=cpu_optimizer_params onto a ZeRO-2 recipe) are
    expected and counted, not failures. User files are not checked here: recipes point at data and model
    directories that exist on the training cluster, not on CI. Compositions are spread over the CPU cores.
    """
    start = time.perf_counter()
    options = group_options()
    bases: List[List[str]] = [[]] + [[f"{RECIPE_GROUP}={r}"] for r in recipes()]
    jobs: List[Tuple[List[str], bool]] = []
    for base in bases:
        jobs.append((base + extra, True))
        for group, opts in options.items():
            if group != RECIPE_GROUP:
                jobs += [(base + extra + [f"{group}={opt}"], False) for opt in opts]
    results = _run_parallel(jobs)
    failures: List[str] = []
    rejected: List[Tuple[str, str]] = []
    for (overrides, _), problems in zip(jobs, results):
        label = " ".join(overrides) or "defaults"
        if problems and problems[0].startswith("RULE "):
            rejected.append((label, problems[0][5:]))
        else:
            failures += [f"{label}: {p}" for p in problems]
    elapsed = time.perf_counter() - start
    n_options = sum(len(v) for k, v in options.items() if k != RECIPE_GROUP)
    print(
        f"validated {len(jobs)} compositions ({len(bases) - 1} recipes and the defaults, each alone and with each of "
        f"{n_options} group options) in {elapsed:.1f}s: {len(failures)} failures, "
        f"{len(rejected)} combinations rejected by cross-field rules (expected)"
    )
    for combo, why in rejected if verbose else rejected[:3]:
        print(f"  rejected: {combo}: {why}")
    if rejected and not verbose:
        print("  ... (--verbose lists them all)")
    if failures:
        raise ConfigError(failures)
    return 0


def _run_parallel(jobs: List[Tuple[List[str], bool]]) -> List[List[str]]:
    import multiprocessing as mp
    import os

    workers = min(len(jobs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if workers <= 1:
        return _check_chunk(jobs)
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("fork").Pool(workers) as pool:
        parts = pool.map(_check_chunk, chunks)
    out: List[List[str]] = [[] for _ in jobs]
    for i, part in enumerate(parts):
        out[i::workers] = part
    return out


def _check_chunk(jobs: List[Tuple[List[str], bool]]) -> List[List[str]]:
    with hydra_context():
        return [_check(overrides, rules_fatal=fatal) for overrides, fatal in jobs]


def _check(overrides: List[str], *, rules_fatal: bool) -> List[str]:
    try:
        composed = compose(overrides)
    except ConfigError as exc:
        return exc.problems
    _, schema_errors, rule_errors = check_composition(composed, check_files=False, overrides=overrides)
    if schema_errors:
        return schema_errors
    if rule_errors:
        return rule_errors if rules_fatal else ["RULE " + "; ".join(rule_errors)]
    return []
