"""Phase timestamps of a run's start, for `benchmarks/bench_rank_start.py --phases` (never imported by dsrecipes).

Python imports `sitecustomize` at start-up from the first sys.path entry that has one; the benchmark puts this
directory on PYTHONPATH (ranks inherit it) and sets BENCH_START_TRACE to a directory. Every process of the run (the
CLI, DeepSpeed's runner and per-node launcher, each rank) then appends JSON lines to `<dir>/<pid>.jsonl`:

  start     the process's creation (from /proc: clock ticks since boot), its command line and parent
  site      this file running: the interpreter is initialised
  import    start and end of the watched modules (a finder in front of sys.meta_path wraps their exec_module)
  call      start and end of watched functions (patched once their module has loaded)
  spawn     a subprocess.Popen, with its argv
  exit      at exit: this process's user+system CPU seconds, and its reaped children's

Each event carries wall time (time.time(): one clock for every process) and this process's CPU seconds so far.

    python benchmarks/start_trace/sitecustomize.py --smoke [--out DIR]

checks the watch lists against the code (run as a script, not as sitecustomize): every module of WATCH_IMPORTS and
WATCH_CALLS is found, and every watched function exists, else it stops naming the stale ones (a renamed function
would otherwise just vanish from the timeline). Result file: <out>/start_trace_sitecustomize.json.
"""


from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time

_DIR = os.environ.get("BENCH_START_TRACE")

WATCH_IMPORTS = ("torch", "deepspeed", "transformers", "datasets", "hydra", "numpy", "dsrecipes", "dsrecipes.cli",
                 "dsrecipes.rank.worker", "dsrecipes.rank.train", "dsrecipes.rank.session", "dsrecipes.run.entry",
                 "dsrecipes.run.launch",
                 "deepspeed.launcher", "deepspeed.launcher.runner", "deepspeed.launcher.launch", "torch.distributed",
                 "deepspeed.comm", "deepspeed.accelerator", "deepspeed.ops", "psutil")
WATCH_CALLS = {
    "deepspeed": ("initialize", "init_distributed"),
    "torch.distributed": ("init_process_group",),
    "dsrecipes.commands.train": ("run_job", "_launch"),
    "dsrecipes.config.load": ("load_config",),
    "dsrecipes.run.entry": ("check_machine", "decide", "plan_data", "write_run_dir", "launch"),
    "dsrecipes.run.launch.process": ("run_subprocess", "run_in_process"),
    "dsrecipes.rank.worker": ("run",),
    "dsrecipes.rank.train": ("loop", "log_window"),
    "dsrecipes.rank.session": ("start", "init_distributed", "load_tokenizer", "build_model", "build_loaders",
                               "build_objective", "read_plan", "export_initial", "build_prompt_eval"),
    "dsrecipes.core.distributed": ("init_distributed",),
    "dsrecipes.core.jit_ops": ("prepare_rank",),
}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _emit(event: str, **fields) -> None:
    line = json.dumps({"t": time.time(), "cpu": _cpu(), "pid": os.getpid(), "event": event, **fields})
    with open(os.path.join(_DIR, f"{os.getpid()}.jsonl"), "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def _created() -> float:
    """This process's creation time (seconds since the epoch, 10 ms resolution)."""
    with open("/proc/self/stat", encoding="utf-8") as fh:
        ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat", encoding="utf-8") as fh:
        boot = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _wrap(module, qual: str, name: str) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "_traced", False):
        return

    @functools.wraps(original)
    def traced(*args, **kwargs):
        _emit("call", name=f"{qual}.{name}", edge="start")
        try:
            return original(*args, **kwargs)
        finally:
            _emit("call", name=f"{qual}.{name}", edge="end")

    traced._traced = True
    setattr(module, name, traced)


class _Finder:
    """Wraps the loader of each watched module so its execution is timed (nested imports included)."""

    def find_spec(self, name, path, target=None):
        if name not in WATCH_IMPORTS and name not in WATCH_CALLS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module") or getattr(loader, "_traced", False):
            return spec
        original = loader.exec_module

        def exec_module(module):
            _emit("import", name=name, edge="start")
            try:
                original(module)
            finally:
                _emit("import", name=name, edge="end")
            for attr in WATCH_CALLS.get(name, ()):
                _wrap(module, name, attr)

        try:
            loader.exec_module = exec_module
            loader._traced = True
        except AttributeError:
            pass
        return spec


def _install() -> None:
    import subprocess

    with open("/proc/self/cmdline", "rb") as fh:
        argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    _emit("start", t0=_created(), argv=argv, ppid=os.getppid())
    _emit("site")
    sys.meta_path.insert(0, _Finder())
    popen_init = subprocess.Popen.__init__

    def init(self, args, *a, **kw):
        _emit("spawn", argv=[str(x) for x in args] if isinstance(args, (list, tuple)) else str(args))
        popen_init(self, args, *a, **kw)
        _emit("spawned", child=self.pid)

    subprocess.Popen.__init__ = init

    def at_exit() -> None:
        t = os.times()
        _emit("exit", children_cpu=t.children_user + t.children_system)

    atexit.register(at_exit)


def check_watch_lists() -> list:
    """The stale entries of the watch lists: modules that cannot be found or imported, functions that are gone."""
    import importlib
    import importlib.util

    stale = []
    for name in WATCH_IMPORTS:
        try:
            if importlib.util.find_spec(name) is None:
                stale.append(f"import {name}: no such module")
        except (ImportError, ValueError) as exc:
            stale.append(f"import {name}: {exc}")
    for name, calls in WATCH_CALLS.items():
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            stale.append(f"calls of {name}: {exc}")
            continue
        stale += [f"call {name}.{call}: no such function" for call in calls if not callable(getattr(module, call, None))]
    return stale


def _main() -> int:
    import argparse

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _harness import Result, add_args

    parser = add_args(argparse.ArgumentParser(description="check the watch lists of the start trace"))
    args = parser.parse_args()
    with Result("start_trace_sitecustomize", args) as result:
        stale = check_watch_lists()
        result.row({"watched_imports": len(WATCH_IMPORTS), "watched_calls": sum(map(len, WATCH_CALLS.values())),
                    "stale": stale})
        if stale:
            raise SystemExit("stale entries in benchmarks/start_trace/sitecustomize.py:\n  " + "\n  ".join(stale))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
elif _DIR:
    _install()
