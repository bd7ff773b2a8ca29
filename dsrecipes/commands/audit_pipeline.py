"""`dsrecipes audit --ledger PIPELINE_DIR`: a pipeline's stages audited together (`dsrecipes pipeline FILE --out
PIPELINE_DIR`), the promise of DeepSpeed-Chat's `--data_split 2,4,4` made checkable: no two stages trained on the
same rows of a dataset they split.

- each stage's run directory (`<out>/<stage>`, as the pipeline writes it; never a path read from the state file)
  is audited as `--ledger RUN` audits a run: every sample once per epoch, equal steps, its evaluations; a stage
  trained without `trainer.record_samples=true` has no ledger, and the audit says its samples were not checked;
- the stages that split the same files (`dataset.split`: the same files, shares and pins, read from each stage's
  config.yaml) must each take another share, and no other stage may read one of those files whole (it would train
  on rows of their shares);
- each such split is audited once as `dsrecipes audit ... dataset.split.take=...` does (split_audit.py): the
  shares are disjoint and cover every row; on the files as they are now, so a file whose content differs from what a
  stage's plan.json recorded it training on is a violation too.

Exit 0 when nothing is violated (stages not yet finished are listed and not audited), 1 otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from dsrecipes.config.load import load_config, read_yaml_mapping
from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import read_json_file
from dsrecipes.core.schema import TrainConfig
from dsrecipes.data.plan.ledger import LEDGER_DIR
from dsrecipes.data.prepare.cache import data_files
from dsrecipes.data.sources.registry import resolve_sources
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
        state = read_json_file(path, "JSON nested too deeply") if path.is_file() else None
    except (OSError, ValueError) as exc:
        raise UserError(f"--ledger: {path} does not read as a pipeline's state ({exc})") from None
    stages = state.get("stages") if isinstance(state, dict) else None
    if not isinstance(stages, dict) or not stages:
        raise UserError(f"--ledger: {out} is a pipeline directory whose {STATE_FILE} lists no stage yet: nothing "
                        "to audit (run the pipeline first)")
    out_list = []
    for name, entry in stages.items():
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise UserError(f"--ledger: {path}: {name!r} is not a stage name the pipeline writes")
        status = entry.get("status") if isinstance(entry, dict) else None
        out_list.append((name, status if isinstance(status, str) else "unknown"))
    return out_list


def _config(run: Path) -> TrainConfig:
    path = run / "config.yaml"
    if not path.is_file():
        raise UserError(f"--ledger: {path} is missing: a finished stage's run directory holds its config.yaml")
    return load_config(read_yaml_mapping(path), check_files=False)


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
    return problems


def _splits(out: Path, configs: Dict[str, TrainConfig]) -> List[str]:
    """The split rules of the module comment; each split's shares audited once."""
    from dsrecipes.data.strategies.split_audit import audit_split  # lazy: else `audit` imports numpy 0.11 s

    groups: Dict[Group, List[Tuple[str, str]]] = {}
    whole: Dict[str, List[str]] = {}  # file -> stages that read it without a split
    for name, cfg in configs.items():
        split, files = cfg.dataset.split, _files(cfg)
        if not split.shares:
            for f in files:
                whole.setdefault(f, []).append(name)
            continue
        key = (*files, json.dumps(dict(split.shares), sort_keys=True), json.dumps(dict(split.pin), sort_keys=True))
        groups.setdefault(key, []).append((name, split.take))
    problems = []
    for key, members in groups.items():
        files = key[:-2]
        print(f"split {key[-2]} of {', '.join(files)}: " + ", ".join(f"{n} took {t!r}" for n, t in members))
        takes: Dict[str, List[str]] = {}
        for name, take in members:
            takes.setdefault(take, []).append(name)
        problems += [f"stages {', '.join(names)} all trained share {take!r} of {', '.join(files)}"
                     for take, names in takes.items() if len(names) > 1]
        problems += [f"stage {reader} read {f} whole while {', '.join(n for n, _ in members)} split it: it trained "
                     "on rows of their shares" for f in files for reader in whole.get(f, [])]
        first = configs[members[0][0]]
        problems += _changed_files(out, first, [n for n, _ in members])
        report = audit_split(first.dataset, first)
        print(report.render())
        problems += [f"split of {', '.join(files)}: {v}" for v in report.violations]
    return problems
