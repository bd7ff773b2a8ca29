"""`dsrecipes audit --ledger PIPELINE_DIR`: a pipeline's stages audited together (`dsrecipes pipeline FILE --out
PIPELINE_DIR`), the promise of DeepSpeed-Chat's `--data_split 2,4,4` made checkable: no two stages trained on the
same rows of a dataset they split.

- each stage's run directory (`<out>/<stage>`, as the pipeline writes it; never a path read from the state file)
  is audited as `--ledger RUN` audits a run: every sample once per epoch, equal steps, its evaluations; a stage
  trained without `trainer.record_samples=true` has no ledger, and the audit says its samples were not checked;
- per file, from each stage's config.yaml (its sources resolved once: registry read, globs expanded; a file is one
  file under any spelling, symlinks resolved, and is named as the first stage reading it names it, another stage's
  other spelling said beside): the stages that split it must use the same `dataset.split.shares` (other shares can
  hold the same rows) and each take another share; no other stage may read it whole, nor pinned into the share it
  takes while another takes a share of it (either trains on rows of the others' shares); a `data=presharded` stage
  is named as not compared (its share was chosen by `dsrecipes shard` and is recorded nowhere);
- a stage directory, or its config.yaml, plan.json or ledger, that is a link is a violation, not audited as the stage;
- each such split is audited once as `dsrecipes audit ... dataset.split.take=...` does (split_audit.py): the
  shares are disjoint and cover every row; on the files as they are now, so a file whose content differs from what a
  stage's plan.json recorded it training on, one gone since (deleted, a FIFO now) or one the stage did not read (a
  glob matching more now) is a violation too;
- each recording stage's ledger traced to those files' rows (`_traced`): a trained sample id naming rows of one share
  only must name rows of the share the stage took, so the proof covers what the model trained on, not only what the
  stages' configs select (ids naming rows of several shares are counted and not compared).

Exit 0 when nothing is violated (stages not yet finished are listed and not audited), 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from dsrecipes.config.load import load_config, read_yaml_mapping
from dsrecipes.config.pipeline_file import _NAME as STAGE_NAME
from dsrecipes.core.choices import BadRows
from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import not_regular, read_json_file
from dsrecipes.core.schema import SourceConfig, TrainConfig
from dsrecipes.data.plan.ledger import LEDGER_DIR, read_ledger
from dsrecipes.data.prepare.cache import data_files
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.registry import resolve_sources
from dsrecipes.data.sources.remote import looks_like_url
from dsrecipes.data.sources.sharegpt import iter_checked, sample_id
from dsrecipes.data.sources.split_shares import share_of_row
from dsrecipes.run.pipeline import MARKER, STATE_FILE

Group = Tuple[str, ...]  # (real files..., shares, pins) as JSON: stages that split the same data the same way
Reading = Tuple[str, str, str]  # (how, shares as JSON, share): what a stage reads of one file, see _reading


@dataclass
class _Stage:
    """A finished stage as its config.yaml says, its sources resolved once (registry read, globs expanded): `files`
    {real path (a URL as written): the file as the stage names it}, `readings` {real path: what it reads of it}."""
    cfg: TrainConfig
    sources: List[SourceConfig]
    files: Dict[str, str]
    readings: Dict[str, Reading]


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
    resolved: Dict[str, _Stage] = {}
    for name in done:
        run = out / name
        linked = [p for p in (run, run / "config.yaml", run / "plan.json", run / LEDGER_DIR) if p.is_symlink()]
        if linked or run.resolve() != out.resolve() / name:
            where = linked[0] if linked else run
            problems.append(f"stage {name}: {where} is a link to {where.resolve()}, not what the pipeline wrote: "
                            "not audited")
            continue
        resolved[name] = _stage(run)
        if not (run / LEDGER_DIR).is_dir():
            unrecorded.append(name)
            print(f"stage {name}: no ledger (trained with trainer.record_samples=false): its samples are not checked")
            continue
        print(f"stage {name}: {run}")
        if audit_ledgers(run) != 0:
            problems.append(f"stage {name}: its ledger audit failed (above)")
    problems += _splits(out, resolved)
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


def _stage(run: Path) -> _Stage:
    path = run / "config.yaml"
    if not path.is_file():
        raise UserError(f"--ledger: {path} is {not_regular(path) or 'missing'}: a finished stage's run directory holds "
                        "its config.yaml")
    mapping = read_yaml_mapping(path)  # its errors name path:line
    try:
        cfg = load_config(mapping, check_files=False)
        sources = resolve_sources(cfg.dataset)  # a registry or dataset.split problem: named with this file, not later
    except UserError as exc:
        raise UserError([f"--ledger: {path}: {p}" for p in exc.problems], exc.footer) from None
    files: Dict[str, str] = {}
    readings: Dict[str, Reading] = {}
    for source in sources:
        reading = _reading(source)
        for written in _written_files(source.paths):
            real = written if looks_like_url(written) else os.path.realpath(written)
            files.setdefault(real, written)  # read_once kept one spelling of each file per stage
            if reading is not None:
                readings[real] = reading
    return _Stage(cfg, sources, files, readings)


def _reading(source: SourceConfig) -> Optional[Reading]:
    """What the stage reads of the source's files: ("whole", "", "") without a split, ("all", shares, share) for a
    source pinned to the share the stage takes, ("share", shares, take) for the rows whose id falls in `take`; None
    for a source pinned to another share (read not at all)."""
    share = source.share
    if share is None:
        return ("whole", "", "")
    if share.pinned is not None and share.pinned != share.take:
        return None
    shares = json.dumps(dict(share.shares), sort_keys=True)
    return ("all", shares, share.take) if share.pinned is not None else ("share", shares, share.take)


def _written_files(paths: List[str]) -> List[str]:
    """The files `paths` (resolve_sources': glob-escaped files, patterns matching nothing) name, as the stage names
    them: globs expanded (what its plan.json records), URLs and patterns matching nothing as written."""
    files: List[str] = []
    for p in paths:
        files += [p] if looks_like_url(p) else (sorted(glob.glob(os.path.expanduser(p))) or [p])
    return files


def _named(f: str, stages: List[Tuple[str, _Stage]]) -> Tuple[str, str]:
    """(file `f` as the first of `stages` names it, the other stages' other spellings of it as a suffix)."""
    names = [(n, stage.files[f]) for n, stage in stages if f in stage.files]
    first = names[0][1] if names else f
    other = [f"stage {n} names it {w}" for n, w in names if w != first]
    return first, f" ({'; '.join(other)})" if other else ""


def _changed_files(out: Path, stages: List[Tuple[str, _Stage]]) -> List[str]:
    """The files of a split that changed since a stage trained on them (its plan.json's {file: content hash}, the
    file as the stage names it): the audit reads the files as they are now, so a changed one proves nothing about
    what that stage read."""
    problems = []
    for name, stage in stages:
        now = data_files(stage.cfg, stage.sources)
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


def _splits(out: Path, stages: Dict[str, _Stage]) -> List[str]:
    """The split rules of the module comment; each split's shares audited once."""
    from dsrecipes.data.strategies import strategy_of  # lazy: else `audit` imports numpy 0.11 s
    from dsrecipes.data.strategies.split_audit import audit_split  # lazy: the same package

    groups: Dict[Group, List[str]] = {}
    sharded = [name for name, stage in stages.items() if not strategy_of(stage.cfg).reads_sources]
    for name in sharded:
        print(f"stage {name}: data={stages[name].cfg.data.kind.value}: the share it trained on was chosen by "
              "`dsrecipes shard` and is not recorded; its rows are not compared with the other stages'")
    stages = {name: stage for name, stage in stages.items() if name not in sharded}
    for name, stage in stages.items():
        split = stage.cfg.dataset.split
        if split.shares:
            key = (*sorted(stage.files), json.dumps(dict(split.shares), sort_keys=True),
                   json.dumps(dict(split.pin), sort_keys=True))
            groups.setdefault(key, []).append(name)
    problems = _overlaps(stages)
    for key, names in groups.items():
        members = [(n, stages[n]) for n in names]
        files = ", ".join("".join(_named(f, members)) for f in key[:-2])
        print(f"split {key[-2]} of {files}: " + ", ".join(f"{n} took {s.cfg.dataset.split.take!r}" for n, s in members))
        problems += _changed_files(out, members)
        first = members[0][1].cfg
        report = audit_split(first.dataset, first)
        print(report.render())
        problems += [f"split of {files}: {v}" for v in report.violations]
        problems += _traced(out, members, files)
    return problems


def _traced(out: Path, members: List[Tuple[str, _Stage]], files: str) -> List[str]:
    """What each recording stage's ledger holds, traced to the rows of the split's files: every trained sample id
    that names rows of one share only must name rows of the share the stage took. An id naming rows of several shares
    (an `id` column repeated across shares) is counted and not compared; an id of no row (a file changed since) is
    `_changed_files`' to report."""
    recording = [(n, stage) for n, stage in members if (out / n / LEDGER_DIR).is_dir()]
    if not recording:
        return []
    first = members[0][1]
    shares_of: Dict[str, set] = {}  # sample id -> the shares of the rows it names
    report = BadRowReport(BadRows.skip, 1.0)  # every row: a row a check refuses still has its id and its share
    for source in first.sources:
        if source.share is None:
            continue
        whole = dataclasses.replace(source, share=None, max_samples=None)

        def id_and_share(row, src, table, share=source.share):
            return sample_id(row.value if row.error is None else None, row, src), share_of_row(row, share)

        for sid, share in iter_checked(whole, report, None, first.cfg.dataset.max_row_bytes, id_and_share):
            shares_of.setdefault(sid, set()).add(share)
    problems = []
    for name, stage in recording:
        take, trained = stage.cfg.dataset.split.take, set()
        for path in sorted((out / name / LEDGER_DIR).glob("rank*.jsonl")):  # checked files (audit_ledgers)
            for ids in read_ledger(path).values():
                trained.update(ids)
        traced = sorted(i for i in trained if len(shares_of.get(i, ())) == 1)
        wrong = [(i, next(iter(shares_of[i]))) for i in traced if shares_of[i] != {take}]
        several = sum(1 for i in trained if len(shares_of.get(i, ())) > 1)
        print(f"stage {name}: its ledger holds {len(trained)} sample ids; {len(traced)} name rows of one share of "
              f"the split: {len(traced) - len(wrong)} of share {take!r}, the share it took"
              + (f"; {several} name rows of several shares (not compared)" if several else ""))
        problems += [f"stage {name} took share {take!r} of {files}, but its ledger holds {i!r}, a row of share "
                     f"{share!r}" for i, share in wrong[:20]]
        if len(wrong) > 20:
            problems.append(f"stage {name}: {len(wrong) - 20} more trained ids of rows of other shares")
    return problems


def _overlaps(stages: Dict[str, _Stage]) -> List[str]:
    """Per file read by a stage that splits it: the stages that can have trained on the same rows of it (the same
    share of the same split, the file read whole or pinned into the share taken, or split with other shares)."""
    readers: Dict[str, List[Tuple[str, Reading]]] = {}
    for name, stage in stages.items():
        for f, reading in stage.readings.items():
            readers.setdefault(f, []).append((name, reading))
    problems = []
    for real, found in sorted(readers.items()):
        if all(how == "whole" for _, (how, _, _) in found):
            continue  # nobody splits it: not a split of this pipeline
        f, aka = _named(real, [(n, stages[n]) for n, _ in found])
        splitters = [n for n, (how, _, _) in found if how != "whole"]
        problems += [f"stage {n} read {f} whole while {', '.join(s for s in splitters)} split it: it trained on rows "
                     f"of their shares{aka}" for n, (how, _, _) in found if how == "whole"]
        split = [(n, r) for n, r in found if r[0] != "whole"]
        takes: Dict[Reading, List[str]] = {}
        for n, reading in split:
            takes.setdefault(("", reading[1], reading[2]), []).append(n)
        problems += [f"stages {', '.join(names)} all trained share {take!r} of {f}{aka}"
                     for (_, _, take), names in takes.items() if len(names) > 1]
        for i, (a, ra) in enumerate(split):
            for b, rb in split[i + 1:]:
                if ra[1] != rb[1]:
                    problems.append(f"stages {a} and {b} split {f} with different dataset.split.shares ({ra[1]} vs "
                                    f"{rb[1]}): their shares can hold the same rows{aka}")
                elif ra[2] != rb[2] and "all" in (ra[0], rb[0]):
                    problems.append(f"stages {a} and {b} split {f} with different dataset.split.pin: one read every "
                                    f"row of it, the other its share of the same rows{aka}")
    return problems
