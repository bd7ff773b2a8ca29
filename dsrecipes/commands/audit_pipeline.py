"""`dsrecipes audit --ledger PIPELINE_DIR`: a pipeline's stages audited together (`dsrecipes pipeline FILE --out
PIPELINE_DIR`), the promise of DeepSpeed-Chat's `--data_split 2,4,4` made checkable: no two stages trained on the
same rows of a dataset they split.

- each stage's run directory (`<out>/<stage>`, as the pipeline writes it; never a path read from the state file)
  is audited as `--ledger RUN` audits a run: every sample once per epoch, equal steps, its evaluations; a stage
  trained without `trainer.record_samples=true` has no ledger, and the audit says its samples were not checked;
- per file (globs expanded, symlinks resolved), from each stage's config.yaml: the stages that split it must use
  the same `dataset.split.shares` (other shares can hold the same rows) and each take another share; no other stage
  may read it whole, nor pinned into the share it takes while another takes a share of it (either trains on rows of
  the others' shares); a `data=presharded` stage is named as not compared (its share was chosen by `dsrecipes shard`
  and is recorded nowhere);
- a stage directory, or its config.yaml, plan.json or ledger, that is a link is a violation, not audited as the stage;
- each such split is audited once as `dsrecipes audit ... dataset.split.take=...` does (split_audit.py): the
  shares are disjoint and cover every row; on the files as they are now, so a file whose content differs from what a
  stage's plan.json recorded it training on, one gone since (deleted, a FIFO now) or one the stage did not read (a
  glob matching more now) is a violation too.

Exit 0 when nothing is violated (stages not yet finished are listed and not audited), 1 otherwise.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from dsrecipes.config.load import load_config, read_yaml_mapping
from dsrecipes.config.pipeline_file import _NAME as STAGE_NAME
from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import not_regular, read_json_file
from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.plan.ledger import LEDGER_DIR
from dsrecipes.data.prepare.cache import data_files
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.remote import looks_like_url
from dsrecipes.run.pipeline import MARKER, STATE_FILE

Group = Tuple[str, ...]  # (files..., shares, pins) as JSON: stages that split the same data the same way


def is_pipeline_dir(path: Path) -> bool:
    return (path / MARKER).is_file()


def audit_pipeline(out: Path, audit_ledgers: Callable[[Path], int]) -> int:
    """Audit every finished stage of the pipeline in `out` and the splits they share (module comment);
    `audit_ledgers(run)`: what `--ledger RUN` does for one run (prints, returns 0 or 1)."""
    stages = _stages(out)
    done = [name for name, status in stages if status == "done"]
    print(f"audit pipeline {out}: stages " + ", ".join(f"{n} ({s})" for n, s in stages))
    problems: List[str] = []
    unrecorded: List[str] = []
    configs: Dict[str, TrainConfig] = {}
    for name in done:
        run = out / name
        linked = [p for p in (run, run / "config.yaml", run / "plan.json", run / LEDGER_DIR) if p.is_symlink()]
        if linked or run.resolve() != out.resolve() / name:
            where = linked[0] if linked else run
            problems.append(f"stage {name}: {where} is a link to {where.resolve()}, not what the pipeline wrote: "
                            "not audited")
            continue
        configs[name] = _config(run)
        if not (run / LEDGER_DIR).is_dir():
            unrecorded.append(name)
            print(f"stage {name}: no ledger (trained with trainer.record_samples=false): its samples are not checked")
            continue
        print(f"stage {name}: {run}")
        if audit_ledgers(run) != 0:
            problems.append(f"stage {name}: its ledger audit failed (above)")
    problems += _splits(out, configs)
    waiting = [name for name, status in stages if status != "done"]
    if waiting:
        print(f"not audited (not finished): {', '.join(waiting)}")
    for problem in problems:
        print(f"VIOLATION: {problem}")
    if problems:
        print(f"FAILED: {len(problems)} violation(s)")
        return 1
    checked = len(done) - len(unrecorded)
    print(f"OK: {len(done)} finished stage(s); ledgers of {checked} checked"
          + (f" ({', '.join(unrecorded)}: not recorded)" if unrecorded else "")
          + "; the stages that split a dataset took disjoint shares")
    return 0


def _stages(out: Path) -> List[Tuple[str, str]]:
    """[(stage, status)] in the pipeline's order, from its state file."""
    path = out / STATE_FILE
    try:
        state = read_json_file(path, "JSON nested too deeply") if os.path.lexists(path) else None
    except (OSError, ValueError) as exc:
        raise UserError(f"--ledger: {path} does not read as a pipeline's state ({exc})") from None
    stages = state.get("stages") if isinstance(state, dict) else None
    if not isinstance(stages, dict) or not stages:
        raise UserError(f"--ledger: {out} is a pipeline directory whose {STATE_FILE} lists no stage yet: nothing "
                        "to audit (run the pipeline first)")
    out_list = []
    for name, entry in stages.items():
        # the pipeline file's own rule (a path or a control character is no stage: printed, it could forge a line)
        if not isinstance(name, str) or not STAGE_NAME.match(name):
            raise UserError(f"--ledger: {path}: {str(name)[:80]!r} is not a stage name the pipeline writes")
        status = entry.get("status") if isinstance(entry, dict) else None
        out_list.append((name, status if isinstance(status, str) else "unknown"))
    return out_list


def _config(run: Path) -> TrainConfig:
    path = run / "config.yaml"
    if not path.is_file():
        raise UserError(f"--ledger: {path} is {not_regular(path) or 'missing'}: a finished stage's run directory holds "
                        "its config.yaml")
    mapping = read_yaml_mapping(path)  # its errors name path:line
    try:
        cfg = load_config(mapping, check_files=False)
        resolve_sources(cfg.dataset)  # a registry or dataset.split problem: named with this file, not later without
    except UserError as exc:
        raise UserError([f"--ledger: {path}: {p}" for p in exc.problems], exc.footer) from None
    return cfg


def _files(cfg: TrainConfig) -> List[str]:
    return sorted({p for source in resolve_sources(cfg.dataset) for p in source.paths})


def _changed_files(out: Path, cfg: TrainConfig, stages: List[str]) -> List[str]:
    """The files of a split that changed since a stage trained on them (its plan.json's {file: content hash}): the
    audit reads the files as they are now, so a changed one proves nothing about what that stage read."""
    now = data_files(cfg, resolve_sources(cfg.dataset))
    problems = []
    for name in stages:
        path = out / name / "plan.json"
        try:
            plan = read_json_file(path, "JSON nested too deeply") if path.is_file() else {}
        except (OSError, ValueError):
            plan = {}
        then = plan.get("data_files") if isinstance(plan, dict) else None
        if not isinstance(then, dict):
            problems.append(f"stage {name}: {path} records no data files, so what it read cannot be compared")
            continue
        problems += [f"{f} changed since stage {name} trained on it (content {then[f]} -> {digest}): the audit "
                     "reads it as it is now" for f, digest in sorted(now.items()) if f in then and then[f] != digest]
        problems += [f"{f} is gone (or no longer a regular file) since stage {name} trained on it: the audit reads "
                     "none of its rows" for f in sorted(set(then) - set(now))]
        problems += [f"{f} is read now but stage {name} did not train on it ({path} records no such file): the audit "
                     "reads the files as they are now" for f in sorted(set(now) - set(then))]
    return problems


def _splits(out: Path, configs: Dict[str, TrainConfig]) -> List[str]:
    """The split rules of the module comment; each split's shares audited once."""
    from dsrecipes.data.strategies import strategy_of  # lazy: else `audit` imports numpy 0.11 s
    from dsrecipes.data.strategies.split_audit import audit_split  # lazy: the same package

    groups: Dict[Group, List[Tuple[str, str]]] = {}
    sharded = [name for name, cfg in configs.items() if not strategy_of(cfg).reads_sources]
    for name in sharded:
        print(f"stage {name}: data={configs[name].data.kind.value}: the share it trained on was chosen by "
              "`dsrecipes shard` and is not recorded; its rows are not compared with the other stages'")
    configs = {name: cfg for name, cfg in configs.items() if name not in sharded}
    for name, cfg in configs.items():
        split = cfg.dataset.split
        if split.shares:
            key = (*_files(cfg), json.dumps(dict(split.shares), sort_keys=True),
                   json.dumps(dict(split.pin), sort_keys=True))
            groups.setdefault(key, []).append((name, split.take))
    problems = _overlaps(configs)
    for key, members in groups.items():
        files = key[:-2]
        print(f"split {key[-2]} of {', '.join(files)}: " + ", ".join(f"{n} took {t!r}" for n, t in members))
        first = configs[members[0][0]]
        problems += _changed_files(out, first, [n for n, _ in members])
        report = audit_split(first.dataset, first)
        print(report.render())
        problems += [f"split of {', '.join(files)}: {v}" for v in report.violations]
    return problems


Reading = Tuple[str, str, str]  # (how, shares as JSON, share): what a stage reads of one file, see _readings


def _readings(cfg: TrainConfig) -> Dict[str, Reading]:
    """{file (glob expanded, symlinks resolved): what the stage reads of it}: ("whole", "", "") without a split,
    ("all", shares, share) for a source pinned to the share the stage takes, ("share", shares, take) for the rows
    whose id falls in `take`; a file of a source pinned to another share is read not at all (left out)."""
    out: Dict[str, Reading] = {}
    for source in resolve_sources(cfg.dataset):
        share = source.share
        if share is None:
            reading: Reading = ("whole", "", "")
        elif share.pinned is not None and share.pinned != share.take:
            continue
        else:
            shares = json.dumps(dict(share.shares), sort_keys=True)
            reading = ("all", shares, share.take) if share.pinned is not None else ("share", shares, share.take)
        for f in _real_files(source.paths):
            out[f] = reading
    return out


def _real_files(paths: List[str]) -> List[str]:
    """The files `paths` name, as one spelling each: globs expanded, symlinks resolved (URLs as written)."""
    files: List[str] = []
    for p in paths:
        if looks_like_url(p):
            files.append(p)
            continue
        files += [os.path.realpath(m) for m in (sorted(glob.glob(os.path.expanduser(p))) or [p])]
    return files


def _overlaps(configs: Dict[str, TrainConfig]) -> List[str]:
    """Per file read by a stage that splits it: the stages that can have trained on the same rows of it (the same
    share of the same split, the file read whole or pinned into the share taken, or split with other shares)."""
    readers: Dict[str, List[Tuple[str, Reading]]] = {}
    for name, cfg in configs.items():
        for f, reading in _readings(cfg).items():
            readers.setdefault(f, []).append((name, reading))
    problems = []
    for f, stages in sorted(readers.items()):
        if all(how == "whole" for _, (how, _, _) in stages):
            continue  # nobody splits it: not a split of this pipeline
        splitters = [n for n, (how, _, _) in stages if how != "whole"]
        problems += [f"stage {n} read {f} whole while {', '.join(s for s in splitters)} split it: it trained on rows "
                     "of their shares" for n, (how, _, _) in stages if how == "whole"]
        split = [(n, r) for n, r in stages if r[0] != "whole"]
        takes: Dict[Reading, List[str]] = {}
        for n, reading in split:
            takes.setdefault(("", reading[1], reading[2]), []).append(n)
        problems += [f"stages {', '.join(names)} all trained share {take!r} of {f}"
                     for (_, _, take), names in takes.items() if len(names) > 1]
        for i, (a, ra) in enumerate(split):
            for b, rb in split[i + 1:]:
                if ra[1] != rb[1]:
                    problems.append(f"stages {a} and {b} split {f} with different dataset.split.shares ({ra[1]} vs "
                                    f"{rb[1]}): their shares can hold the same rows")
                elif ra[2] != rb[2] and "all" in (ra[0], rb[0]):
                    problems.append(f"stages {a} and {b} split {f} with different dataset.split.pin: one read every "
                                    "row of it, the other its share of the same rows")
    return problems
