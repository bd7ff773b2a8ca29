"""`dsrecipes validate [--all] [overrides]`: compose + schema + rules, without importing torch."""

from __future__ import annotations

import time
from typing import List, Tuple

from dsrecipes.cli import override_parser, parse
from dsrecipes.config.groups import RECIPE_GROUP, group_options, recipes
from dsrecipes.config.load import check_composition, compose, compose_and_load, hydra_context
from dsrecipes.errors import ConfigError


def main(argv: List[str]) -> int:
    parser = override_parser("validate", "Validate one composition, or every recipe x every group option (--all).")
    parser.add_argument("--all", action="store_true", help="every recipe x every option of every group")
    parser.add_argument("--verbose", action="store_true", help="--all: list every combination the rules reject")
    args = parse(parser, argv)
    if args.all:
        with hydra_context():
            return validate_all(args.overrides, verbose=args.verbose)
    cfg = compose_and_load(args.overrides)
    print(
        f"OK: data={cfg.data.kind.value} dataset={cfg.dataset.name} model={cfg.model.name} "
        f"zero={cfg.zero.stage} offload={cfg.offload.name} precision={cfg.precision.dtype.value} "
        f"launcher={cfg.launcher.kind.value}"
    )
    return 0


def validate_all(extra: List[str], *, verbose: bool = False) -> int:
    """Each recipe must validate on its own; each group option, composed onto each recipe, must pass the schema.

    Combinations that the cross-field rules reject (e.g. offload=cpu_optimizer_params onto a ZeRO-2 recipe) are
    expected and counted, not failures. User files are not checked here: recipes point at data and model
    directories that exist on the training cluster, not on CI.
    """
    start = time.perf_counter()
    options = group_options()
    bases: List[List[str]] = [[]] + [[f"{RECIPE_GROUP}={r}"] for r in recipes()]
    failures: List[str] = []
    rejected: List[Tuple[str, str]] = []
    checked = 0
    for base in bases:
        label = base[0] if base else "defaults"
        failures += [f"{label}: {p}" for p in _check(base + extra, rules_fatal=True)]
        checked += 1
        for group, opts in options.items():
            if group == RECIPE_GROUP:
                continue
            for opt in opts:
                overrides = base + extra + [f"{group}={opt}"]
                problems = _check(overrides, rules_fatal=False)
                checked += 1
                if problems and problems[0].startswith("RULE "):
                    rejected.append((" ".join(overrides), problems[0][5:]))
                elif problems:
                    failures += [f"{' '.join(overrides)}: {p}" for p in problems]
    elapsed = time.perf_counter() - start
    print(
        f"validated {checked} compositions ({len(bases) - 1} recipes x {sum(len(v) for k, v in options.items() if k != RECIPE_GROUP)} "
        f"group options, plus defaults) in {elapsed:.1f}s: {len(failures)} failures, "
        f"{len(rejected)} combinations rejected by cross-field rules (expected)"
    )
    for combo, why in rejected if verbose else rejected[:3]:
        print(f"  rejected: {combo}: {why}")
    if rejected and not verbose:
        print("  ... (--verbose lists them all)")
    if failures:
        raise ConfigError(failures)
    return 0


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
