"""`dsrecipes validate [--all] [overrides]`: compose + schema + rules, without importing torch."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from dsrecipes.boundary.trust import FLAG, TRUST_HELP, trust
from dsrecipes.commands.args import existing_path, override_parser, parse
from dsrecipes.config.defaults import config_warnings, model_name
from dsrecipes.config.groups import RECIPE_GROUP, group_options
from dsrecipes.config.load import check_composition, compose, compose_and_load, hydra_context
from dsrecipes.config.matrix import as_container, layer, plan_all, recipe_body
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.worker_pool import WorkerLost, WorkerPool
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.val_share import held_out
from dsrecipes.run.preflight import check_environment, check_template_tokens


def main(argv: List[str]) -> int:
    parser = override_parser("validate", "Validate one composition, or every recipe x every group option (--all).")
    parser.add_argument("--all", action="store_true", help="every recipe x every option of every group")
    parser.add_argument("--verbose", action="store_true", help="--all: list every combination the rules reject")
    parser.add_argument(FLAG, action="append", default=[], type=existing_path, metavar="PATH", help=TRUST_HELP)
    args = parse(parser, argv)
    trust(args.trust_checkpoint, "dsrecipes validate ...")  # what train would load (objective.reward_model) is checked as train checks it
    if args.all:
        return validate_all(args.overrides, verbose=args.verbose)
    cfg = compose_and_load(args.overrides)

    problems = check_environment(cfg) + check_template_tokens(cfg)  # paths, names, tokens: no model loaded
    split_problems, split_warnings = held_out_rows(cfg)
    if problems + split_problems:
        raise ConfigError(problems + split_problems)
    for warning in config_warnings(cfg) + split_warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(
        f"OK: data={cfg.data.kind.value} dataset={source_names(cfg)} model={model_name(cfg)} "
        f"zero={cfg.zero.stage} offload={cfg.offload.label} precision={cfg.precision.dtype.value} "
        f"launcher={cfg.launcher.kind.value}"
    )
    return 0


def held_out_rows(cfg: Any) -> Tuple[List[str], List[str]]:
    """(problems, warnings) of the share `dataset.val_size` holds out, where the rows are known (val_share.py)."""
    from dsrecipes.data.strategies.rules import reads_sources  # lazy: numpy

    return held_out(cfg) if reads_sources(cfg) else ([], [])


def source_names(cfg: Any) -> str:
    """The sources a run of `cfg` reads, as `train` resolves them (`registry.resolve_sources`): `my_chats+glaive_en`,
    or `sample` alone when nothing else is named."""
    from dsrecipes.data.strategies.rules import reads_sources  # lazy: numpy

    if not reads_sources(cfg):
        return cfg.dataset.name
    return "+".join(src.name for src in resolve_sources(cfg.dataset, [])) or cfg.dataset.name


def validate_all(extra: List[str], *, verbose: bool = False) -> int:
    """Each recipe must validate on its own; each group option, composed onto each recipe, must pass the schema.

    Combinations that the cross-field rules reject (e.g. offload=cpu_optimizer_params onto a ZeRO-2 recipe) are
    expected and counted, not failures. User files are not checked here: recipes point at data and model
    directories that exist on the training cluster, not on CI. Hydra composes the defaults, each recipe and every
    option (in rows, in parallel over the CPU cores); the products are layered from those (config/matrix.py).
    """
    from dsrecipes.config.hydra_app import register_schemas  # lazy: else `commands.validate` imports hydra 0.12 s

    start = time.perf_counter()
    register_schemas()  # the resolvers the option and recipe files may use
    plan = plan_all(extra)
    progress = Progress(len(plan.composes) + len(plan.checks))
    composed = _compose_parallel(plan.composes, progress)
    _split_failed_rows(plan, composed)
    _compose_products_of_failed_bases(plan, composed, progress)
    failures: List[str] = []
    rejected: List[Tuple[str, str]] = []
    for check in plan.checks:
        schema_errors, rule_errors = composed[tuple(check.overrides)][1:] if check.real else _layered(check, plan, composed)
        progress.advance(1)
        label = " ".join(check.overrides) or "defaults"
        if schema_errors or (rule_errors and check.rules_fatal):
            failures += [f"{label}: {p}" for p in schema_errors + rule_errors]
        elif rule_errors:
            rejected.append((label, "; ".join(rule_errors)))
    progress.done()
    elapsed = time.perf_counter() - start
    options = group_options()
    n_options = sum(len(v) for k, v in options.items() if k != RECIPE_GROUP)
    n_recipes = len(options.get(RECIPE_GROUP, []))
    print(
        f"validated {len(plan.checks)} compositions ({n_recipes} recipes and the defaults, each alone and with each "
        f"of {n_options} group options; {len(composed)} Hydra composes, the rest layered) in {elapsed:.1f}s: "
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
    """One line on a terminal's stderr, rewritten in place ("validate --all: 120/327"); piped, a line every
    PIPED_LINE_S while it lasts (an extra override makes every composition a Hydra compose: ~1.5 min on 2 cores)."""

    PIPED_LINE_S = 10.0

    def __init__(self, total: int):
        self.total, self.count = total, 0
        self.live = sys.stderr.isatty()
        self.said = time.monotonic()

    def advance(self, n: int) -> None:
        self.count += n
        if self.live and (self.count == self.total or self.count % 8 == 0):
            print(f"\rvalidate --all: {self.count}/{self.total}", end="", file=sys.stderr, flush=True)
        elif not self.live and time.monotonic() - self.said >= self.PIPED_LINE_S:
            self.said = time.monotonic()
            print(f"validate --all: {self.count}/{self.total} compositions checked", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.live:
            print("\r" + " " * 40 + "\r", end="", file=sys.stderr, flush=True)


def _layered(check: Any, plan: Any, composed: Dict[Tuple[str, ...], Composed]) -> Tuple[List[str], List[str]]:
    group, option = check.option
    base = composed[tuple([f"{RECIPE_GROUP}={check.base}"] if check.base else [])]
    opt = composed[tuple(plan.sources[check.option])]
    if base[0] is None or opt[0] is None:  # the recipe or the option failed on its own: reported there
        return (base[1] or opt[1])[:1], []
    data = layer(base[0], group, option, opt[0], recipe_body(check.base))
    _, schema_errors, rule_errors = check_composition(data, check_files=False, overrides=check.overrides)
    return schema_errors, rule_errors


def _split_failed_rows(plan: Any, composed: Dict[Tuple[str, ...], Composed]) -> None:
    """A row of options that fails is composed option by option, so each problem names its file."""
    for opt, source in list(plan.sources.items()):
        if len(source) > 1 and composed[tuple(source)][0] is None:
            single = [f"{opt[0]}={opt[1]}"]
            if tuple(single) not in composed:
                composed.update(zip([tuple(single)], _compose_chunk([single])))
            plan.sources[opt] = single


def _compose_products_of_failed_bases(plan: Any, composed: Dict[Tuple[str, ...], Composed],
                                      progress: Progress) -> None:
    """A base that fails alone may still compose with another option (`recipe=R zero=stage1` never loads R's broken
    zero file): its products are composed for real, as the user would."""
    todo = [c for c in plan.checks if not c.real and composed[tuple(c.overrides[:1] if c.base else [])][0] is None]
    for check in todo:
        check.real = True
    progress.total += len(todo)
    composed.update(_compose_parallel([c.overrides for c in todo], progress))


CHUNK_TIMEOUT_S = 60.0  # one chunk (<= 4 composes, well under a second each) from a forked compose worker
WAIT_LINE_S = 10.0  # a worker silent this long is named on the console while the wait lasts
REAP_S = 5.0  # a finished worker's own exit, before it is killed


def _compose_parallel(jobs: List[List[str]], progress: Progress) -> Dict[Tuple[str, ...], Composed]:
    """In forked workers (core/worker_pool.py): the chunks of one that dies or stays silent CHUNK_TIMEOUT_S (a lock
    held by another thread at fork time) are composed in this process, with a line that says so."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    size = max(1, min(4, len(jobs) // (2 * cores)))
    chunks = [jobs[i: i + size] for i in range(0, len(jobs), size)]
    out: Dict[Tuple[str, ...], Composed] = {}
    if cores <= 1 or len(chunks) <= 1:
        _compose_here(chunks, out, progress)
        return out
    pool = WorkerPool(min(cores, len(chunks)), _compose_chunk, label="validate --all", name="compose worker",
                      waiting=_waiting, line_s=WAIT_LINE_S, bound_s=CHUNK_TIMEOUT_S, reap_s=REAP_S)
    try:
        for chunk in chunks:
            pool.submit(chunk)
        while pool.pending:
            try:
                chunk, part = pool.next()
            except WorkerLost as lost:
                n = sum(len(c) for c in lost.tasks)
                if lost.silent_s is None:
                    print(f"validate --all: compose worker pid {lost.pids} ended ({lost.statuses()}) before its "
                          f"last {len(lost.tasks)} chunks; composing them in this process", file=sys.stderr, flush=True)
                else:
                    print(f"validate --all: a compose worker gave no answer in {lost.silent_s:g} s (pid {lost.pids}); "
                          f"composing its remaining {n} in this process", file=sys.stderr, flush=True)
                _compose_here(lost.tasks, out, progress)
                continue
            out.update(zip(map(tuple, chunk), part))
            progress.advance(len(chunk))
    finally:
        pool.close()
    return out


def _waiting(silent_s: float, pids: List[int], _chunks: List[Any]) -> str:
    return (f"validate --all: waiting for compose worker pid {', '.join(map(str, pids))} (no answer for "
            f"{silent_s:.0f} s; composed here after {CHUNK_TIMEOUT_S:g} s)")


def _compose_here(chunks: List[List[List[str]]], out: Dict[Tuple[str, ...], Composed], progress: Progress) -> None:
    for chunk in chunks:
        out.update(zip(map(tuple, chunk), _compose_chunk(chunk)))
        progress.advance(len(chunk))


def _compose_chunk(chunk: List[List[str]]) -> List[Composed]:
    out: List[Composed] = []
    with hydra_context():
        for overrides in chunk:
            try:
                composed = compose(overrides)
            except ConfigError as exc:
                out.append((None, exc.problems, []))
                continue
            cfg, schema_errors, rule_errors = check_composition(composed, check_files=False, overrides=overrides)
            out.append((None if cfg is None else as_container(composed), schema_errors, rule_errors))
    return out
