"""`dsrecipes validate [--all] [overrides]`: compose + schema + rules, without importing torch."""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from dsrecipes.commands.args import override_parser, parse
from dsrecipes.config.groups import RECIPE_GROUP, group_options
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
    print(
        f"OK: data={cfg.data.kind.value} dataset={cfg.dataset.name} model={cfg.model.name} "
        f"zero={cfg.zero.stage} offload={cfg.offload.label} precision={cfg.precision.dtype.value} "
        f"launcher={cfg.launcher.kind.value}"
    )
    return 0


def validate_all(extra: List[str], *, verbose: bool = False) -> int:
    """Each recipe must validate on its own; each group option, composed onto each recipe, must pass the schema.

    Combinations that the cross-field rules reject (e.g. offload=cpu_optimizer_params onto a ZeRO-2 recipe) are
    expected and counted, not failures. User files are not checked here: recipes point at data and model
    directories that exist on the training cluster, not on CI. Hydra composes each recipe and each option once (in
    parallel over the CPU cores); the recipe x option products are layered from those (config/matrix.py).
    """
    from dsrecipes.config.matrix import plan_all

    start = time.perf_counter()
    plan = plan_all(extra)
    progress = Progress(len(plan.jobs))
    composed = _compose_parallel(plan.real(), progress)
    failures: List[str] = []
    rejected: List[Tuple[str, str]] = []
    for job in plan.jobs:
        schema_errors, rule_errors = composed[_key(job.overrides)][1:] if job.real else _layered(job, composed)
        if not job.real:
            progress.advance(1)
        label = " ".join(job.overrides) or "defaults"
        if schema_errors or (rule_errors and job.rules_fatal):
            failures += [f"{label}: {p}" for p in schema_errors + rule_errors]
        elif rule_errors:
            rejected.append((label, "; ".join(rule_errors)))
    progress.done()
    elapsed = time.perf_counter() - start
    options = group_options()
    n_options = sum(len(v) for k, v in options.items() if k != RECIPE_GROUP)
    n_recipes = len(options.get(RECIPE_GROUP, []))
    print(
        f"validated {len(plan.jobs)} compositions ({n_recipes} recipes and the defaults, each alone and with each "
        f"of {n_options} group options; {len(plan.real())} composed by Hydra, the rest layered) in {elapsed:.1f}s: "
        f"{len(failures)} failures, {len(rejected)} combinations rejected by cross-field rules (expected)"
    )
    for combo, why in rejected if verbose else rejected[:3]:
        print(f"  rejected: {combo}: {why}")
    if rejected and not verbose:
        print("  ... (--verbose lists them all)")
    if failures:
        raise ConfigError(failures)
    return 0


Composed = Tuple[Optional[Dict[str, Any]], List[str], List[str]]  # (container, schema problems, rule problems)


class Progress:
    """One line on a terminal's stderr, rewritten in place ("validate --all: 120/276"); silent when piped."""

    def __init__(self, total: int):
        self.total, self.count = total, 0
        self.live = sys.stderr.isatty()

    def advance(self, n: int) -> None:
        self.count += n
        if self.live and (self.count == self.total or self.count % 8 == 0):
            print(f"\rvalidate --all: {self.count}/{self.total} compositions", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.live:
            print("\r" + " " * 60 + "\r", end="", file=sys.stderr, flush=True)


def _key(overrides: List[str]) -> Tuple[str, ...]:
    return tuple(overrides)


def _layered(job: Any, composed: Dict[Tuple[str, ...], Composed]) -> Tuple[List[str], List[str]]:
    from dsrecipes.config.matrix import layer, recipe_body

    group, option = job.option
    base = composed[_key([f"{RECIPE_GROUP}={job.base}"])]
    opt = composed[_key([f"{group}={option}"])]
    if base[0] is None or opt[0] is None:  # the recipe or the option failed on its own: reported there
        return (base[1] or opt[1])[:1], []
    data = layer(base[0], group, option, opt[0], recipe_body(job.base))
    _, schema_errors, rule_errors = check_composition(data, check_files=False, overrides=job.overrides)
    return schema_errors, rule_errors


def _compose_parallel(jobs: List[Any], progress: Progress) -> Dict[Tuple[str, ...], Composed]:
    import multiprocessing as mp
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    chunks = [[j.overrides for j in jobs[i: i + 4]] for i in range(0, len(jobs), 4)]
    out: Dict[Tuple[str, ...], Composed] = {}
    if cores <= 1 or len(chunks) <= 1:
        parts = map(_compose_chunk, chunks)
        for chunk, part in zip(chunks, parts):
            out.update(zip(map(_key, chunk), part))
            progress.advance(len(chunk))
        return out
    with mp.get_context("fork").Pool(min(cores, len(chunks))) as pool:
        for chunk, part in zip(chunks, pool.imap(_compose_chunk, chunks)):
            out.update(zip(map(_key, chunk), part))
            progress.advance(len(chunk))
    return out


def _compose_chunk(chunk: List[List[str]]) -> List[Composed]:
    from omegaconf import OmegaConf

    out: List[Composed] = []
    with hydra_context():
        for overrides in chunk:
            try:
                composed = compose(overrides)
            except ConfigError as exc:
                out.append((None, exc.problems, []))
                continue
            cfg, schema_errors, rule_errors = check_composition(composed, check_files=False, overrides=overrides)
            data = None
            if cfg is not None:
                data = OmegaConf.to_container(composed, resolve=True, enum_to_str=True)
                data.pop("hydra", None)
            out.append((data, schema_errors, rule_errors))
    return out
