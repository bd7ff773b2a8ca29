"""The launching process: from a validated TrainConfig to a written run directory and running ranks.

Compose once, then launch (commands/train.py composes and validates): this process refuses what cannot run on this
machine, prepares the data (bad rows fail here, before any process group), makes the run plan (world size, rows,
steps, resume point, data fingerprint), writes the run directory (config.yaml, plan.json, ds_config.json) and starts
the ranks, which only read that directory.
"""

from __future__ import annotations

import dataclasses
import glob
from pathlib import Path
from typing import Optional, Tuple

from dsrecipes.config.load import config_to_dict
from dsrecipes.config.schema import DataKind, TrainConfig
from dsrecipes.errors import ConfigError
from dsrecipes.runplan import RunPlan, write_plan
from dsrecipes.topology import Topology, resolve_topology


def run(cfg: TrainConfig) -> int:
    """Prepare, plan, write the run directory (`trainer.output_dir`), launch. Returns the ranks' exit code."""
    import torch

    from dsrecipes.config.validate import check_runtime
    from dsrecipes.launch import launch
    from dsrecipes.model import check_no_custom_code
    from dsrecipes.resolve import prepare_launch
    from dsrecipes.trackers import preflight

    problems = check_runtime(cfg, cuda_available=torch.cuda.is_available()) + preflight(cfg)
    if problems:
        raise ConfigError(problems)
    cfg = prepare_launch(cfg)  # hub ids -> local snapshots, template=auto -> concrete, warnings: decided once here
    check_no_custom_code(cfg)  # on the local snapshot a hub id became
    run_dir = Path(cfg.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = write_run_dir(cfg, resolve_topology(cfg.launcher))
    print(f"run directory: {run_dir}  ({describe_plan(plan)})", flush=True)
    return launch(cfg, run_dir)


def write_run_dir(cfg: TrainConfig, topology: Topology) -> RunPlan:
    """Prepare the data and plan the run, then write config.yaml, plan.json and ds_config.json."""
    from dsrecipes.ds_config import build_ds_config
    from dsrecipes.rundir import write_config, write_ds_config

    run_dir = Path(cfg.trainer.output_dir)
    plan = plan_run(cfg, run_dir, topology)
    write_config(run_dir, config_to_dict(cfg))
    write_plan(run_dir, plan)
    write_ds_config(run_dir, build_ds_config(cfg, plan.world_size, load_universal=plan.elastic))
    return plan


def with_run_dir(cfg: TrainConfig, hydra_run_dir: Path) -> TrainConfig:
    """`trainer.output_dir` wins (resume into an existing run); else Hydra's run directory. Returns a new config."""
    out = Path(cfg.trainer.output_dir).expanduser() if cfg.trainer.output_dir else hydra_run_dir
    trainer = dataclasses.replace(cfg.trainer, output_dir=str(out.resolve()))
    return dataclasses.replace(cfg, trainer=trainer)


def plan_run(cfg: TrainConfig, run_dir: Path, topology: Topology) -> RunPlan:
    """Every decision the ranks follow: what they read, how many steps, where they resume from."""
    from dsrecipes.checkpoint import plan_resume
    from dsrecipes.data.plan import plan_steps

    rows, fingerprint = plan_data(cfg, run_dir)
    per_epoch, total = plan_steps(cfg, topology.world_size, rows)
    resume = plan_resume(cfg.trainer, run_dir, topology.world_size, cfg.zero.stage)
    return RunPlan(world_size=topology.world_size, num_nodes=topology.num_nodes, data_kind=cfg.data.kind.value,
                   rows=rows, steps_per_epoch=per_epoch, total_steps=total, data_fingerprint=fingerprint,
                   resume=resume)


def plan_data(cfg: TrainConfig, run_dir: Path) -> Tuple[Optional[int], str]:
    """(training rows of an epoch, data fingerprint), after preparing (`map`), indexing and scanning (`iterable`:
    the samples of one epoch, counted by the stream index) or reading the shard manifest (`presharded`)."""
    if cfg.data.kind is DataKind.map:
        from dsrecipes.data.prepare import prepare
        from dsrecipes.model import load_tokenizer

        prepared = prepare(cfg, load_tokenizer(cfg), run_dir)
        return len(prepared.train), prepared.stats["cache_key"]
    if cfg.data.kind is DataKind.presharded:
        from dsrecipes.data.shard import read_manifest

        manifest = read_manifest(cfg.data.shard_dir)
        if cfg.data.prescan:
            _check_parts(cfg, run_dir, manifest)
        return manifest.total, manifest.fingerprint
    from dsrecipes.data.scan import prepare_stream

    return prepare_stream(cfg, run_dir)


def _check_parts(cfg: TrainConfig, run_dir: Path, manifest) -> None:
    """Parts are checked by `dsrecipes shard` with its template and tokenizer; with another one, a row could fail to
    render or tokenize mid-run, so the parts are scanned first."""
    from dsrecipes.config.schema import SourceConfig
    from dsrecipes.data.scan import scan_sources
    from dsrecipes.data.shard import checked_alike
    from dsrecipes.model import load_tokenizer

    if checked_alike(manifest.checked_with, cfg, load_tokenizer(cfg)):
        return
    parts = [SourceConfig(name=f"part{r}", paths=[glob.escape(manifest.part_path(r))]) for r in range(manifest.parts)]
    scan_sources(cfg, run_dir, parts)


def describe_plan(plan: RunPlan) -> str:
    text = f"world size {plan.world_size}, {plan.total_steps} optimizer steps"
    if plan.resume is not None:
        text += f", resuming from step {plan.resume.step}" + (" (elastic)" if plan.elastic else "")
    return text
