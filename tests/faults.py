"""Fault injection for the tests, from outside the production code (issue 42 item 5): dsrecipes reads no test hook.

A fault replaces one rank-side function with a wrapper that misbehaves at a given optimizer step:

  nan_at_step=N         rank 0's loss of step N becomes NaN (`step_guard.StepGuard.add`): a real poison for the step
  pause_after_step=N    rank 0 idles after step N until the run is asked to stop, or for 120 s (`train.after_step`):
                        a run in flight at a known step when the test signals it or kills its launching process
  stall_after_step=N    rank 0 sleeps for an hour after step N, unless N is the last step (`train.after_step`): the
                        other ranks wait in their next collective while a test kills a node
  kill_before_latest=N  every rank exits with 17 once all ranks have written step N's checkpoint files, before rank 0
                        commits it (`checkpoint._stop_if_full`, the agreement right after the writes)
  stall_before_rendezvous=R  rank R sleeps for an hour before it joins the process group (`distributed.
                        init_distributed`): a rank hung before the rendezvous, as a node that never started
  exit_before_rendezvous=R   rank R exits with 3 before it joins the process group: a rank dead before the rendezvous

A wrapper checks the signature of what it wraps when it is installed, so a moved fault point fails the test that
needs it instead of silently injecting nothing.

Two ways in:
- `injected(**faults)`: a context manager that patches the modules of this process (runs inside pytest's process,
  `launcher=local` in process), and puts them back afterwards.
- `fault_env(where, **faults)`: the environment for a run in other processes. The ranks are started by the launching
  process through deepspeed, torchrun or pdsh, each a separate interpreter, and the launching process builds their
  environment from positive allow-lists (boundary/rank_env.py: `launcher.env` never takes a path such as PYTHONPATH,
  and .deepspeed_env carries only those names and the object-store settings). What every launcher does pass on,
  without dsrecipes' help, is the launching process's own PYTHONPATH: single-node launchers and torchrun inherit the
  whole environment, and DeepSpeed's runner exports every PYTHON* variable to pdsh's remote ranks itself
  (deepspeed/launcher/runner.py, EXPORT_ENVS). So the test puts a directory of its own in front of PYTHONPATH: a
  `sitecustomize.py` (Python imports it at start-up from the first sys.path entry that has one; this environment
  has none of its own) and `faults.json` beside it. In every process of the run the shim loads this file and calls
  `install(faults)`, which waits for the target modules with a finder in front of sys.meta_path and patches each
  right after it executes; it imports nothing of dsrecipes itself (the launching process still loads no torch). No
  variable is read by dsrecipes and the boundary has nothing to refuse: a user's PYTHONPATH was always theirs.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

Undo = List[Tuple[Any, str, Any]]  # (owner, attribute, original)


def _replace(owner: Any, name: str, params: List[str], make: Callable[[Any], Any]) -> Undo:
    original = getattr(owner, name)  # AttributeError: the fault point is gone
    found = list(inspect.signature(original).parameters)
    if found != params:
        raise RuntimeError(f"tests/faults.py: {owner.__name__}.{name}{tuple(found)} is no longer the fault point "
                           f"it was written for {tuple(params)}")
    setattr(owner, name, make(original))
    return [(owner, name, original)]


def _nan_at_step(step_guard: Any, step: int) -> Undo:
    def make(original):
        def add(self, loss, batch, at):
            if self.rank == 0 and at == step:
                loss = loss * float("nan")
            return original(self, loss, batch, at)

        return add

    return _replace(step_guard.StepGuard, "add", ["self", "loss", "batch", "step"], make)


def _pause_after_step(train: Any, step: int) -> Undo:
    def make(original):
        def after_step(s):
            original(s)
            if s.rank == 0 and s.state.step == step:
                deadline = time.monotonic() + 120
                while not train.stop_requested(s) and time.monotonic() < deadline:
                    time.sleep(0.05)

        return after_step

    return _replace(train, "after_step", ["s"], make)


def _stall_after_step(train: Any, step: int) -> Undo:
    def make(original):
        def after_step(s):
            original(s)
            last = s.state.step >= s.plan.total_steps or s.state.selection.get("stopped")
            if s.rank == 0 and s.state.step == step and not last and not train.stop_requested(s):
                time.sleep(3600)

        return after_step

    return _replace(train, "after_step", ["s"], make)


def _kill_before_latest(checkpoint: Any, step: int) -> Undo:
    staging_name = checkpoint.tag_for(step) + checkpoint.PARTIAL

    def make(original):
        def stop_if_full(root, staging, full):
            original(root, staging, full)  # every rank wrote its files and agreed (or OutOfSpace was raised)
            if Path(staging).name == staging_name:
                os._exit(17)  # a crash between the shard writes and the commit

        return stop_if_full

    return _replace(checkpoint, "_stop_if_full", ["root", "staging", "full"], make)


def _before_rendezvous(action: Callable[[], None]) -> Callable[[Any, int], Undo]:
    def fault(distributed: Any, rank: int) -> Undo:
        def make(original):
            def init_distributed(before_join=None):
                if os.environ.get("RANK") == str(rank):
                    action()
                return original(before_join)

            return init_distributed

        return _replace(distributed, "init_distributed", ["before_join"], make)

    return fault


FAULTS: Dict[str, Tuple[str, Callable[[Any, int], Undo]]] = {
    "nan_at_step": ("dsrecipes.rank.step_guard", _nan_at_step),
    "pause_after_step": ("dsrecipes.rank.train", _pause_after_step),
    "stall_after_step": ("dsrecipes.rank.train", _stall_after_step),
    "kill_before_latest": ("dsrecipes.rank.checkpoint", _kill_before_latest),
    "stall_before_rendezvous": ("dsrecipes.core.distributed", _before_rendezvous(lambda: time.sleep(3600))),
    "exit_before_rendezvous": ("dsrecipes.core.distributed", _before_rendezvous(lambda: os._exit(3))),
}


def _checked(faults: Dict[str, Any]) -> Dict[str, int]:
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        raise ValueError(f"unknown faults {unknown}; tests/faults.py knows {sorted(FAULTS)}")
    return {name: int(step) for name, step in faults.items()}


def _apply(module: Any, faults: Dict[str, int]) -> Undo:
    undo: Undo = []
    for name, step in faults.items():
        target, patch = FAULTS[name]
        if target == module.__name__:
            undo += patch(module, step)
    return undo


@contextmanager
def injected(**faults: int) -> Iterator[None]:
    """The faults in this process (imports their modules), for the duration of the block."""
    faults = _checked(faults)
    undo: Undo = []
    try:
        for target in sorted({FAULTS[name][0] for name in faults}):
            undo += _apply(importlib.import_module(target), faults)
        yield
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)


class _Finder:
    """Patches each target module right after it has executed (wraps its loader's exec_module)."""

    def __init__(self, faults: Dict[str, int]):
        self.faults = faults
        self.targets = {FAULTS[name][0] for name in faults}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.targets:
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if finder is not self and hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        self.targets.discard(name)
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _apply(module, self.faults)

        spec.loader.exec_module = exec_module
        return spec


def install(faults: Dict[str, Any]) -> None:
    """For the sitecustomize shim: the faults in this process, in modules loaded already or once they load."""
    faults = _checked(faults)
    finder = _Finder(faults)
    for target in sorted(finder.targets):
        if target in sys.modules:
            finder.targets.discard(target)
            _apply(sys.modules[target], faults)
    if finder.targets:
        sys.meta_path.insert(0, finder)


SHIM = '''"""Written by tests/faults.py (fault_env): the faults of faults.json in every process that starts with this
directory on PYTHONPATH."""
import importlib.util as _util
import json as _json
import os as _os
import sys as _sys

with open(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "faults.json"), encoding="utf-8") as _fh:
    _config = _json.load(_fh)
_spec = _util.spec_from_file_location("dsrecipes_test_faults", _config["plugin"])
_plugin = _util.module_from_spec(_spec)
_sys.modules[_spec.name] = _plugin
_spec.loader.exec_module(_plugin)
_plugin.install(_config["faults"])
'''


def fault_env(where: Path, **faults: int) -> Dict[str, str]:
    """{"PYTHONPATH": ...} that injects `faults` into every process of a run started with it (merge it into the
    subprocess environment). The shim directory is `where/faults-<digest>`, written once per set of faults."""
    faults = _checked(faults)
    config = {"plugin": str(Path(__file__).resolve()), "faults": faults}
    text = json.dumps(config, sort_keys=True)
    folder = Path(where) / f"faults-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if not (folder / "sitecustomize.py").is_file():
        staging = Path(where) / f".{folder.name}.{os.getpid()}"
        staging.mkdir(parents=True)
        (staging / "faults.json").write_text(text, encoding="utf-8")
        (staging / "sitecustomize.py").write_text(SHIM, encoding="utf-8")
        try:
            staging.rename(folder)
        except OSError:  # written meanwhile by another process: the same content
            for child in staging.iterdir():
                child.unlink()
            staging.rmdir()
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(folder) + (os.pathsep + inherited if inherited else "")}
