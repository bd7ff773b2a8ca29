"""Training entry: `python -m dsrecipes [overrides]` (a Hydra app, so `-m` sweeps and `--cfg job` work).

Compose once, then launch: this process validates the composition, refuses what cannot run on this machine,
prepares the data (bad rows fail here, before any process group), plans the step count, writes the run directory
(config.yaml, ds_config.json) and starts the ranks, which only read that directory.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsrecipes.config.load import compose_and_load, config_to_dict, load_config, register_schemas
from dsrecipes.config.schema import DataKind, TrainConfig
from dsrecipes.errors import ConfigError, UserError

RESULT_FILE = "result.json"  # read by the sweep summary (dsrecipes.sweep)

# Flags that make Hydra print or inspect instead of running a job: no pre-validation for those.
_HYDRA_INFO_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--resolve", "--package", "-p",
                     "--shell-completion", "-sc", "--version"}


class _Outcome:
    exit_code = 0


def main(argv: List[str]) -> int:
    multirun = any(a in ("-m", "--multirun") for a in argv)
    informational = any(a.split("=", 1)[0] in _HYDRA_INFO_FLAGS for a in argv)
    if not multirun and not informational:
        # Fail fast with our own message (exit 2) instead of Hydra's traceback-style report.
        compose_and_load([a for a in argv if not a.startswith(("-", "hydra."))])
    from hydra import main as hydra_main

    from dsrecipes.paths import conf_dir

    register_schemas()
    _Outcome.exit_code = 0
    saved_argv = sys.argv
    sys.argv = [saved_argv[0]] + list(argv)
    try:
        hydra_main(config_path=str(conf_dir()), config_name="train", version_base="1.3")(_job)()
    finally:
        sys.argv = saved_argv
    return _Outcome.exit_code


def _job(composed: Any) -> None:
    """One Hydra job (the only one, or one point of a sweep). A failure is reported, never raised to Hydra."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode.name == "MULTIRUN"
    status = "ok"
    try:
        cfg = with_run_dir(load_config(composed, overrides=list(hc.overrides.task)), run_dir)
        run_dir = Path(cfg.trainer.output_dir)
        code = run(cfg)
        error = None if code == 0 else f"ranks exited with code {code}"
        status = "dry_run" if cfg.launcher.dry_run and code == 0 else status
    except UserError as exc:
        print(exc.render(), file=sys.stderr)
        code, error = exc.exit_code, exc.render()
    except Exception as exc:  # noqa: BLE001 - a sweep must go on; a single run re-raises below
        if not multirun:
            raise
        import traceback

        traceback.print_exc()
        code, error = 1, f"{type(exc).__name__}: {exc}"
    write_result(run_dir, code, error, status)
    _Outcome.exit_code = _Outcome.exit_code or code


def run(cfg: TrainConfig) -> int:
    """Prepare, write the run directory (`trainer.output_dir`), launch. Returns the ranks' exit code."""
    import torch

    from dsrecipes import launch
    from dsrecipes.config.validate import check_runtime

    run_dir = Path(cfg.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    problems = check_runtime(cfg, cuda_available=torch.cuda.is_available())
    if problems:
        raise ConfigError(problems)
    world = launch.world_size(cfg)
    total_steps = write_run_dir(cfg, world)
    print(f"run directory: {run_dir}  (world size {world}, {total_steps} optimizer steps)", flush=True)
    return launch.launch(cfg, run_dir)


def write_run_dir(cfg: TrainConfig, world_size: int) -> int:
    """Prepare the data, then write config.yaml and ds_config.json into `trainer.output_dir`; returns total steps."""
    from dsrecipes.checkpoint import resume_is_elastic
    from dsrecipes.ds_config import build_ds_config

    run_dir = Path(cfg.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    total_steps = plan_run(cfg, run_dir, world_size)
    write_atomic(run_dir / "config.yaml", yaml_text(config_to_dict(cfg)))
    elastic = resume_is_elastic(cfg.trainer.resume, run_dir, world_size, cfg.zero.stage)
    ds = build_ds_config(cfg, world_size, total_steps, load_universal=elastic)
    write_atomic(run_dir / "ds_config.json", json.dumps(ds, indent=2) + "\n")
    return total_steps


def with_run_dir(cfg: TrainConfig, hydra_run_dir: Path) -> TrainConfig:
    """`trainer.output_dir` wins (resume into an existing run); else Hydra's run directory. Returns a new config."""
    out = Path(cfg.trainer.output_dir).expanduser() if cfg.trainer.output_dir else hydra_run_dir
    trainer = dataclasses.replace(cfg.trainer, output_dir=str(out.resolve()))
    return dataclasses.replace(cfg, trainer=trainer)


def plan_run(cfg: TrainConfig, run_dir: Path, world_size: int) -> int:
    """Prepare or check what the ranks will read; return the run's optimizer steps (equal on every rank)."""
    from dsrecipes.data.plan import plan_steps

    rows: Optional[int] = None
    if cfg.data.kind is DataKind.map:
        from dsrecipes.data.prepare import prepare
        from dsrecipes.model import load_tokenizer

        rows = len(prepare(cfg, load_tokenizer(cfg), run_dir).train)
    elif cfg.data.kind is DataKind.iterable and cfg.data.prescan:
        from dsrecipes.data.scan import scan_stream

        scan_stream(cfg, run_dir)
    _, total = plan_steps(cfg, world_size, rows)
    return total


def yaml_text(data: Dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def write_atomic(path: Path, text: str) -> None:
    """Readers (ranks, other nodes) never see half a file: write beside, then rename into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_result(run_dir: Path, code: int, error: Optional[str], status: str = "ok") -> None:
    """<run>/result.json: status plus the headline numbers from metrics.jsonl (for sweep summaries)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result: Dict[str, Any] = {"status": status if code == 0 else "failed", "exit_code": code, "error": error}
    result.update(summarize_run(run_dir))
    write_atomic(run_dir / RESULT_FILE, json.dumps(result, indent=2) + "\n")


def summarize_run(run_dir: Path) -> Dict[str, Any]:
    """Final train/eval loss, mean tokens/s and peak resident memory (this process and its ranks)."""
    import resource

    from dsrecipes.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    speeds = [r["tokens_per_s"] for r in train[1:] if r.get("tokens_per_s")]  # the first window includes warm-up
    peak_kb = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return {
        "steps": train[-1]["step"] if train else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
        "peak_mem_mb": round(peak_kb / 1024, 1),
    }
