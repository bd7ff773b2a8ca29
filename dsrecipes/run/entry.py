"""The launching process: from a validated TrainConfig to a written run directory and running ranks.

Compose once, then launch (commands/train.py composes, validates and claims the run directory): this process
refuses what cannot run on this machine (preflight.py), decides the resume point (a verified checkpoint) and checks
that the config may continue it (resume_contract.py) before it writes anything, then prepares the data (bad rows
fail here, before any process group), makes the run plan (world size, rows, steps, resume point, data
fingerprint), writes the run directory (config.yaml, plan.json, ds_config.json) and starts the ranks, which only
read that directory.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import dsrecipes.boundary.trust as trust
import dsrecipes.run.legacy_keys as legacy_keys
import dsrecipes.run.resume_contract as resume_contract
from dsrecipes.boundary.checkpoint_find import committed, plan_resume
from dsrecipes.config.load import read_yaml_mapping
from dsrecipes.config.validate import check_runtime
from dsrecipes.core.checkpoint_names import read_record
from dsrecipes.core.errors import ConfigError, Refused, UserError
from dsrecipes.core.export_dir import EXPORT_DIR, check_out_dir
from dsrecipes.core.fileio import read_json_file
from dsrecipes.core.hub import resolve_hub_paths
from dsrecipes.core.rank_records import clear_outcome
from dsrecipes.core.rundir import CHECKPOINTS_DIR, RESULT_FILE, holds_run, write_config, write_ds_config
from dsrecipes.core.runplan import ResumePlan, RunPlan, write_plan
from dsrecipes.core.schema import Device, LauncherKind, ResumeMode, TrainConfig
from dsrecipes.core.tokenizer import check_no_custom_code, load_tokenizer
from dsrecipes.core.topology import Topology, local_devices, resolve_topology, train_batch_size
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.prepare.cache import preparation_record
from dsrecipes.data.strategies import PrepareResult, plan_steps, strategy_of
from dsrecipes.observe.trackers import preflight
from dsrecipes.run.data_change import DataChange
from dsrecipes.run.ds_config import build_ds_config
from dsrecipes.run.launch import launch
from dsrecipes.run.micro_batch import settle as settle_micro_batch
from dsrecipes.run.preflight import check_environment
from dsrecipes.run.resolve import prepare_launch


def check_machine(cfg: TrainConfig) -> TrainConfig:
    """What cannot run on this machine (fp16 without CUDA, unwritable directories, a broken model directory, ...):
    one ConfigError listing everything, before the run directory is claimed or any rank starts. Returns the config
    the run uses: model choices made once (resolve.prepare_launch)."""
    import torch


    problems = check_runtime(cfg, cuda_available=torch.cuda.is_available()) + preflight(cfg)
    problems += check_environment(resolve_hub_paths(cfg))  # a hub id's local snapshot (downloaded now if need be)
    if problems:
        raise ConfigError(problems)
    cfg = prepare_launch(cfg)  # hub ids -> local snapshots, template=auto -> concrete, warnings: decided once here
    check_no_custom_code(cfg)  # on the local snapshot a hub id became
    return cfg


@dataclass
class Decision:
    """What the run continues from and on which data, decided before anything is written (see `decide`)."""

    topology: Topology
    tokenizer: Any  # the strategy's `needs_tokenizer` (map: the preparation key hashes it), else None
    data_fingerprint: str
    data_files: Dict[str, str]
    resume: Optional[ResumePlan]
    config: Optional[TrainConfig] = None  # the config the run continues with (a run of an older version: its legacy
    # values, run/legacy_keys.py); run() writes it into config.yaml, which the ranks read


def decide(cfg: TrainConfig, topology: Optional[Topology] = None, overrides: Sequence[str] = ()) -> Decision:
    """Read-only: the run's topology, data identity and resume point, with the resume contract checked. Refused
    (exit 2) here, the run directory stays exactly as it was. A run started by an older version continues with the
    values it trained as for the keys added since (legacy_keys.continue_as_started, said in one line), except those
    the command line (`overrides`) sets: the contract compares them."""

    run_dir = Path(cfg.trainer.output_dir)
    topology = topology or resolve_topology(cfg.launcher)
    check_fresh_start(cfg, run_dir)
    if cfg.trainer.export:  # refused now, not after the training

        check_out_dir(run_dir / EXPORT_DIR, "trainer.export")
    tokenizer = None
    if strategy_of(cfg).needs_tokenizer:  # map: the preparation cache key hashes the tokenizer

        tokenizer = load_tokenizer(cfg)
    resume = plan_resume(cfg.trainer, run_dir, topology.world_size, cfg.zero.stage)
    saved = _saved_config(Path(resume.checkpoint)) if resume is not None else None
    if saved is not None:  # before the data is identified: a legacy dataset key chooses the files read
        cfg = continue_as_started(cfg, saved, resume.checkpoint, overrides)
    fingerprint, files = "", {}  # a fresh stream: identified by the pass that indexes it (plan_run), not read twice
    if resume is not None or not getattr(strategy_of(cfg), "identity_in_prepare", False):
        fingerprint, files = data_identity(cfg, tokenizer)
    if resume is not None:
        check_resume(cfg, resume, fingerprint, files, tokenizer, overrides)
    return Decision(topology, tokenizer, fingerprint, files, resume, cfg)


def continue_as_started(cfg: TrainConfig, saved: Dict[str, Any], checkpoint: str,
                        overrides: Sequence[str]) -> TrainConfig:
    """`cfg` with the legacy values of the keys added since the checkpoint's run started (legacy_keys.py), said."""
    cfg, changed = legacy_keys.continue_as_started(cfg, saved, overrides)
    if changed:
        print(f"continuing {checkpoint} as it started, with its values for settings added since: "
              f"{', '.join(changed)}", flush=True)
    return cfg


def run(cfg: TrainConfig, decision: Optional[Decision] = None) -> int:
    """Plan, write the run directory (`trainer.output_dir`, already claimed: rundir.claim), launch. Returns the
    ranks' exit code."""

    run_dir = Path(cfg.trainer.output_dir)
    cfg = decision.config if decision is not None and decision.config is not None else cfg  # as decided (legacy)
    cfg = settle_micro_batch(cfg, run_dir)  # trainer.micro_batch_size=auto: the recorded or probed number
    again = (run_dir / RESULT_FILE).is_file()  # an earlier attempt ended here (e.g. interrupted before its checkpoint)
    plan = write_run_dir(cfg, resolve_topology(cfg.launcher), decision)
    clear_outcome(run_dir)
    print(f"run directory: {run_dir}  ({describe_plan(plan, again)})", flush=True)
    return launch(cfg, run_dir)


def write_run_dir(cfg: TrainConfig, topology: Topology, decision: Optional[Decision] = None) -> RunPlan:
    """Prepare the data and plan the run, then write config.yaml, plan.json and ds_config.json."""

    run_dir = Path(cfg.trainer.output_dir)
    decision = decision or decide(cfg, topology)
    cfg = decision.config or cfg  # a requeued run of an older version: its legacy values (decide)
    plan = plan_run(cfg, run_dir, decision)
    write_config(run_dir, config_to_dict(cfg))
    write_plan(run_dir, plan)
    write_ds_config(run_dir, build_ds_config(cfg, plan.world_size, load_universal=plan.elastic))
    return plan


def with_run_dir(cfg: TrainConfig, hydra_run_dir: Path) -> TrainConfig:
    """`trainer.output_dir` wins (resume into an existing run); else Hydra's run directory. Returns a new config."""
    out = Path(cfg.trainer.output_dir).expanduser() if cfg.trainer.output_dir else hydra_run_dir
    trainer = dataclasses.replace(cfg.trainer, output_dir=str(out.resolve()))
    return dataclasses.replace(cfg, trainer=trainer)


def plan_run(cfg: TrainConfig, run_dir: Path, decision: Decision) -> RunPlan:
    """Every decision the ranks follow: what they read, how many steps, where they resume from."""

    topology = decision.topology
    prepared = plan_data(cfg, run_dir, decision.tokenizer, decision.data_fingerprint, topology.world_size)
    if not decision.data_fingerprint:  # identified while preparing (decide)
        decision = dataclasses.replace(decision, data_fingerprint=prepared.fingerprint, data_files=prepared.files or {})
    per_epoch, total = plan_steps(cfg, topology.world_size, prepared)
    left = None if per_epoch is None or prepared.rows is None else prepared.rows - per_epoch * train_batch_size(
        cfg, topology.world_size)
    if left:  # what an epoch trains: its whole steps (the rank's summary counts samples, not these rows)
        print(f"note: an epoch is {per_epoch} steps of {train_batch_size(cfg, topology.world_size)} rows, so the "
              f"last {left} of its {prepared.rows} training rows (in that epoch's order) are not trained in it",
              file=sys.stderr, flush=True)
    one_of_many_gpus(cfg)
    past_stop = decision.resume is not None and check_budget(cfg, decision.resume, total)
    newest = committed(run_dir / CHECKPOINTS_DIR)
    return RunPlan(world_size=topology.world_size, num_nodes=topology.num_nodes, data_kind=cfg.data.kind.value,
                   rows=prepared.rows, steps_per_epoch=per_epoch, total_steps=total,
                   data_fingerprint=decision.data_fingerprint, resume=decision.resume, data_files=decision.data_files,
                   data_prepared=preparation_record(decision.tokenizer),
                   newest_checkpoint=newest[0].name if newest else None,
                   supervised=cfg.launcher.kind is not LauncherKind.slurm, past_stop=past_stop,
                   exports=trust.accepted_exports())


def one_of_many_gpus(cfg: TrainConfig) -> None:
    """launcher=local (the default) is one process: on a machine with several GPUs that is one of them, which a
    LLaMA-Factory or torchrun user does not expect. Said once, with the launcher that uses them all."""
    if cfg.launcher.kind is not LauncherKind.local or cfg.trainer.device is Device.cpu:
        return
    count = local_devices()
    if count > 1:
        print(f"note: launcher=local trains on 1 of this machine's {count} GPUs; launcher=deepspeed (or torchrun) "
              "trains on all of them", file=sys.stderr, flush=True)


def check_fresh_start(cfg: TrainConfig, run_dir: Path) -> None:
    """A run directory that holds a run is continued, never restarted over (metrics, checkpoints and retention
    would mix two runs): `trainer.resume=never` there, or a resume from another run's checkpoint, is refused."""

    held = holds_run(run_dir)
    if held is None:
        return
    if cfg.trainer.resume is ResumeMode.never:
        raise Refused(f"trainer.resume=never: {run_dir} already holds a run ({held}); starting over there would "
                        "mix or delete it. Choose a new trainer.output_dir, or continue it with trainer.resume=auto "
                        "(nothing was changed)")
    source = None if cfg.trainer.resume_from is None else Path(cfg.trainer.resume_from).expanduser().resolve()
    if source is not None and source != run_dir.resolve() and run_dir.resolve() not in source.parents:
        raise Refused(f"trainer.resume_from: {source} belongs to another run, but {run_dir} already holds a "
                            f"run ({held}); continue another run's checkpoint in a new trainer.output_dir "
                            "(nothing was changed)")


def check_budget(cfg: TrainConfig, resume: ResumePlan, total: int) -> bool:
    """Exit 2 before anything is written when the resumed run would train no step; True when it trains past an
    early stop (resume_contract.check_budget)."""
    tag_dir = Path(resume.checkpoint)
    try:
        record = read_record(tag_dir)
    except (OSError, ValueError):
        record = {}
    config_path = tag_dir / "config.yaml"
    if not config_path.is_file():
        config_path = tag_dir.parent.parent / "config.yaml"  # checkpoints of older versions (as check_resume)
    saved = read_yaml_mapping(config_path) if config_path.is_file() else {}  # a foreign one's too: bounded
    try:
        # the resumed run's result: another user's run too (--trust-checkpoint), so bounded (no FIFO wait, no
        # RecursionError); unreadable reads as not finished
        result = read_json_file(tag_dir.parent.parent / RESULT_FILE, "JSON nested too deeply")
    except (OSError, ValueError):
        result = None
    finished = isinstance(result, dict) and result.get("status") == "ok" and (result.get("steps") or 0) >= resume.step
    return resume_contract.check_budget(str(tag_dir), resume.step, total, record,
                                        saved if isinstance(saved, dict) else {}, config_to_dict(cfg), finished)


def data_identity(cfg: TrainConfig, tokenizer: Any) -> Tuple[str, Dict[str, str]]:
    """(fingerprint, {file: content hash}) of the training data, without writing anything (the strategy's
    `identity`: map's preparation cache key, the shard manifest's, the stream's)."""
    return strategy_of(cfg).identity(cfg, tokenizer)


def check_resume(cfg: TrainConfig, resume: ResumePlan, fingerprint: str, files: Dict[str, str],
                 tokenizer: Any = None, overrides: Sequence[str] = ()) -> None:
    """The resume contract against what wrote the checkpoint (its config.yaml and complete.json; for checkpoints
    of older versions, its run directory's config.yaml and plan.json). Exit 2 listing every difference that
    cannot resume; one line for the accepted ones. What prepared the checkpoint's data is its run plan's record,
    trusted only when that plan has the checkpoint's fingerprint (the plan of the launch that wrote it)."""

    tag_dir = Path(resume.checkpoint)
    record = read_record(tag_dir)
    saved = _saved_config(tag_dir)
    if saved is None:
        return  # a bare checkpoint without its settings: nothing to compare against
    saved_data, saved_files = record.get("data_fingerprint"), record.get("data_files") or {}
    plan_path = tag_dir.parent.parent / "plan.json"
    plan = _saved_plan(plan_path)
    saved_data = plan.get("data_fingerprint") if saved_data is None else saved_data
    prepared = plan.get("data_prepared") if plan.get("data_fingerprint") == saved_data else None
    data = DataChange(saved_files, files, prepared if isinstance(prepared, dict) else None,
                      preparation_record(tokenizer),
                      val_files=bool(cfg.dataset.val_paths), registry=bool(cfg.dataset.use))
    line = resume_contract.check(saved, config_to_dict(cfg), saved_data, fingerprint, str(tag_dir), data,
                                 legacy_keys.explicit_keys(overrides))
    if line:
        print(line, flush=True)


def _saved_config(tag_dir: Path) -> Optional[Dict[str, Any]]:
    """The settings that wrote the checkpoint: its config.yaml, or for checkpoints of older versions its run
    directory's; None when neither is there."""
    config_path = tag_dir / "config.yaml"
    if not config_path.is_file():
        config_path = tag_dir.parent.parent / "config.yaml"
    return read_yaml_mapping(config_path) if config_path.is_file() else None


def _saved_plan(path: Path) -> Dict[str, Any]:
    """The plan.json beside a checkpoint, as far as it can be read ({} otherwise): within fileio's bounds (a FIFO is
    never waited on, a huge or deeply nested file never read whole)."""
    try:
        plan = read_json_file(path, "JSON nested too deeply") if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return plan if isinstance(plan, dict) else {}


def plan_data(cfg: TrainConfig, run_dir: Path, tokenizer: Any, fingerprint: str, world_size: int) -> PrepareResult:
    """The strategy's preparation (map: prepare and cache; iterable: index and scan; presharded: check the parts)
    and what it found: the training rows of an epoch, the validation rows. The data must still be what `decide`
    fingerprinted. `trainer.eval_every` with no validation data is a note, here, once."""
    prepared = strategy_of(cfg).prepare(cfg, Path(run_dir), tokenizer, world_size)
    if fingerprint and prepared.fingerprint != fingerprint:
        raise UserError("the training data changed while the run was being planned; start it again")
    if prepared.val_rows == 0 and cfg.trainer.eval_every > 0:
        print(f"note: trainer.eval_every={cfg.trainer.eval_every}, but this run has no validation data, so it will "
              "not evaluate (give dataset.val_paths or dataset.val_size; for data=presharded, "
              "`dsrecipes shard --val-size N` or dataset.val_paths)", file=sys.stderr, flush=True)
    return prepared


def describe_plan(plan: RunPlan, again: bool = False) -> str:
    text = f"world size {plan.world_size}, {plan.total_steps} optimizer steps"
    if plan.resume is not None:
        text += f", resuming from step {plan.resume.step}" + (" (elastic)" if plan.elastic else "")
    elif again:
        text += ", no checkpoint yet: starting from step 1"
    return text
