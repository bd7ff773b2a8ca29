"""`trainer.micro_batch_size=auto`, the launching side: decide the run's micro-batch once and record it.

`settle(cfg, run_dir)` (entry.run, before the run directory is written) returns `cfg` unchanged for a number. For
`auto` it returns the config with a number in its place:
  - the one recorded in the run directory: `micro_batch.json` (a probe's record), else the number in the run's
    `config.yaml` (the run being resumed ran with it). A resume never probes again: the number the checkpoint's
    steps were made with stays, also after a restart on another machine;
  - else found by the probe, `python -m dsrecipes.rank.batch_probe` in a subprocess on this node's first GPU (this
    process never imports torch): the largest micro-batch up to LIMIT that trains full-length rows of the run's
    model, ZeRO JSON and objective without running out of memory (rank/batch_probe.py says how), written whole to
    `micro_batch.json` with what was tried, and said on the console.
`config.yaml` then holds the number, so ranks, `requeue` and later resumes read it like any other setting. Without
a CUDA GPU the run is refused before anything is written (config/validate.py check_runtime: a GPU-only choice).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import atomic_write_json
from dsrecipes.core.rundir import CONFIG_FILE
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.typed import config_to_dict
from dsrecipes.run.ds_config import build_ds_config

AUTO = "auto"
RECORD_FILE = "micro_batch.json"
LIMIT = 256  # the largest size tried: beyond it a step is long enough that a larger one gains nothing
PROBE_TIMEOUT_S = 900.0
KEY = "trainer.micro_batch_size"


def settle(cfg: TrainConfig, run_dir: Path, probe: Optional[Callable[[TrainConfig], Dict[str, Any]]] = None
           ) -> TrainConfig:
    """`cfg` with `trainer.micro_batch_size=auto` replaced by the recorded or probed number (see the module)."""
    if cfg.trainer.micro_batch_size != AUTO:
        return cfg
    found = recorded(Path(run_dir))
    if found is None:
        record = (probe or run_probe)(cfg)
        atomic_write_json(Path(run_dir) / RECORD_FILE, record)
        found = (int(record["micro_batch_size"]), f"the largest that fits one {record.get('device', 'GPU')}, "
                 f"tried {[size for size, _ in record.get('tried', [])]}; recorded in {Path(run_dir) / RECORD_FILE}")
    size, how = found
    print(f"{KEY}=auto: {size} ({how})", flush=True)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_size=size))


def needs_number(cfg: TrainConfig, what: str) -> None:
    """For commands that compute with the micro-batch before any run (estimate, show, audit): `auto` is one
    message, as the number only exists once a run's probe found it."""
    if cfg.trainer.micro_batch_size == AUTO:
        raise UserError(f"{KEY}: auto is found by a probe on the GPU when the run starts (its run directory's "
                        f"config.yaml then holds the number); {what} for a number, e.g. {KEY}=8")


def recorded(run_dir: Path) -> Optional[Tuple[int, str]]:
    """(size, where it was read) from the run directory's record or config.yaml; None when neither holds one."""
    path = run_dir / RECORD_FILE
    if path.is_file():
        try:
            size = json.loads(path.read_text(encoding="utf-8"))["micro_batch_size"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"{path}: unreadable record of {KEY}=auto ({exc}); remove it to probe again") from None
        if not _whole(size):
            raise UserError(f"{path}: micro_batch_size must be an integer >= 1, got {size!r}; remove it to probe again")
        return size, f"recorded in {path}"
    path = run_dir / CONFIG_FILE
    if path.is_file():
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        size = (data.get("trainer") or {}).get("micro_batch_size") if isinstance(data, dict) else None
        if _whole(size):
            return size, f"the run's own, from {path}"
    return None


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def probe_request(cfg: TrainConfig) -> Dict[str, Any]:
    """What the probe reads on stdin: the run's config and its DeepSpeed JSON for one rank, one row a step."""
    one = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_size=1, grad_accum=1))
    return {"config": config_to_dict(one), "ds_config": build_ds_config(one, 1), "limit": LIMIT}


def run_probe(cfg: TrainConfig) -> Dict[str, Any]:
    """The probe's record (rank/batch_probe.py's protocol), from a subprocess bounded by PROBE_TIMEOUT_S."""
    request = probe_request(cfg)
    print(f"{KEY}=auto: trying micro-batches of {cfg.data.cutoff_len}-token rows on this node's GPU (up to {LIMIT}; "
          f"at most {PROBE_TIMEOUT_S:.0f} s)", flush=True)
    try:
        done = _run_alone(_probe_argv(), json.dumps(request), PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"{KEY}=auto: the probe did not finish within {PROBE_TIMEOUT_S:.0f} s; set a number "
                        "instead") from None
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode == 0 and lines:
        try:
            record = json.loads(lines[-1])
        except ValueError:
            record = {}
        if _whole(record.get("micro_batch_size")):
            return record
    said = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == 2 and said:
        raise UserError(said[-1])
    raise UserError(f"{KEY}=auto: the probe failed (exit {done.returncode}: "
                    f"{said[-1] if said else 'no message'}); set a number instead")


def _probe_argv() -> List[str]:
    return [sys.executable, "-m", "dsrecipes.rank.batch_probe"]


def _run_alone(argv: List[str], stdin: str, bound_s: float) -> subprocess.CompletedProcess:
    """`argv` in a session of its own, fed `stdin`, for at most `bound_s` (TimeoutExpired): however it ends (the
    bound, Ctrl-C), what it started too (a JIT build's compilers) is killed, not only the probe itself."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(stdin, timeout=bound_s)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            proc.communicate()  # reaped (nothing is left to hold its pipes open)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
