"""Time from launch to the first optimizer step of a 2-rank CPU run, cold and warm, with a second Python environment
interleaved (issue 22 item 1).

    python benchmarks/bench_rank_start.py                    # default config (tiny model, sample data)
    python benchmarks/bench_rank_start.py zero=stage2 offload=cpu_optimizer   # a config with a JIT op to build (DeepSpeedCPUAdam)
    python benchmarks/bench_rank_start.py --pairs 5 --keep /tmp/bench
    python benchmarks/bench_rank_start.py --phases           # where a 2-rank and a 1-rank start spend their time
    git worktree add /tmp/before main && python benchmarks/bench_rank_start.py --before /tmp/before   # before/after
    python benchmarks/bench_rank_start.py --smoke            # B built, one 1-rank start of B (preparing its data)

Two environments: A is this interpreter, B a real virtual environment beside it (another sys.prefix, the same
packages), so each has its own JIT build directory (dsrecipes/core/jit_ops.py). B is `python -m venv
--system-site-packages` run by A's interpreter plus a .pth file that adds A's own site directories (`site.addsitedir`,
so A's .pth files count too): when A is itself a virtual environment, --system-site-packages alone would give B only
the base interpreter's packages (no torch). B is checked to find torch and deepspeed before any run. Both start
from an empty torch extensions cache (XDG_CACHE_HOME points into the workspace; TORCH_EXTENSIONS_DIR is unset).

  cold     the first 2-rank run of A, then of B (whatever either builds, it builds here); always in this order, one
           each: B starts with the shared packages' files in the page cache A's start read, so cold B minus
           cold A is not a difference between the environments (only the ops each builds are)
  warm     `--pairs` rounds, each one 2-rank run of A, one of B and one 1-rank run (launcher=local) of A, the order
           rotating every round (A/B alternating), so a build B triggers would show in A's next start; with
           `--before CHECKOUT` also a 2-rank and a 1-rank run of that code (interpreter A), in the same rotation
The time is from starting `python -m dsrecipes` to the moment step 1's metrics line is written (polled every
0.05 s). The data is prepared once, before any timed run, with a separate cache. After each run the built ops'
libraries are listed with their modification times: "rebuilt" marks a run that rebuilt an op another run had built.
Reported: each run, then median and range (min-max) per kind, and warm 2-rank minus 1-rank. On a shared machine
wall time mostly measures the neighbours, so each run's CPU time (user + system, every process of the run, the
whole 1-step run) is reported too: the work a start costs, whatever else runs.

`--phases` runs one traced 2-rank and one traced 1-rank run (after the data is prepared) and prints, process by
process (CLI, DeepSpeed's launcher, each rank), when it was created, its imports of torch/deepspeed/transformers/
dsrecipes, the calls of the start (config, data plan, process group, model, deepspeed.initialize, first step) and
its CPU seconds: benchmarks/start_trace/ (a sitecustomize on PYTHONPATH, only in these runs).

Result file: <out>/bench_rank_start.json (--out DIR): every run (kind, environment, ranks, seconds, CPU seconds,
op builds) and the notes.
"""

from __future__ import annotations

import argparse
import os
import resource
import site
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from _harness import Result, add_args  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "start_trace"))
from timeline import timeline  # noqa: E402  (benchmarks/start_trace/timeline.py)

TRACER = Path(__file__).resolve().parent / "start_trace"

RUN = ["debug=fast", "trainer.max_steps=1", "trainer.log_every=1", "trainer.save_every=0", "trainer.eval_every=0",
       "dataset.val_size=0", "trainer.export=false", "trainer.resume=never"]


def environment(ws: Path, cache: Path, repo: Path = Path(__file__).resolve().parents[1]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCH_EXTENSIONS_DIR")}
    env.update({"XDG_CACHE_HOME": str(cache), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH")) if p)
    return env


def environment_b(venv: Path) -> str:
    """Interpreter B: a virtual environment with A's packages (see the module docstring); its python."""
    python = venv / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    dirs = [d for d in [*site.getsitepackages(), site.getusersitepackages()] if os.path.isdir(d)]
    line = "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs)
    Path(purelib, "bench_rank_start_env_a.pth").write_text(line + "\n", encoding="utf-8")
    probe = "import importlib.util as u, sys; assert u.find_spec('torch') and u.find_spec('deepspeed'); print(sys.prefix)"
    check = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"environment B ({python}) does not see torch and deepspeed:\n{check.stderr[-1500:]}")
    if check.stdout.strip() == sys.prefix:
        raise SystemExit(f"environment B ({python}) has A's sys.prefix {sys.prefix}: not a second environment")
    return str(python)


def built_ops(cache: Path) -> Dict[str, float]:
    return {str(p.relative_to(cache)): p.stat().st_mtime for p in cache.rglob("*.so")} if cache.is_dir() else {}


def cpu_seconds() -> float:
    """user + system CPU time of every finished descendant (ranks and launchers are reaped down the chain)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start_to_first_step(python: str, ws: Path, name: str, ranks: int, overrides: List[str],
                        env: Dict[str, str], wall: Optional[List[float]] = None) -> float:
    from dsrecipes.core.rundir import read_metrics

    run, n = ws / "runs" / name, 1
    while run.exists():  # a kept workspace (--keep) run again: every run gets a new directory
        n += 1
        run = ws / "runs" / f"{name}.{n}"
    name = run.name
    launcher = ["launcher=local"] if ranks == 1 else ["launcher=deepspeed", f"launcher.num_gpus={ranks}"]
    argv = [python, "-m", "dsrecipes", *RUN, *launcher, f"data.cache_dir={ws / 'data'}", f"trainer.output_dir={run}",
            f"hydra.run.dir={run}", *overrides]
    log = open(ws / f"{name}.log", "w")
    started = time.perf_counter()
    if wall is not None:
        wall.append(time.time())
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ws)
    first = None
    while first is None:
        if any(r.get("step") == 1 and "loss" in r for r in read_metrics(run)):
            first = time.perf_counter() - started
        elif proc.poll() is not None:
            raise SystemExit(f"{name} ended (code {proc.returncode}) before step 1; see {ws / (name + '.log')}")
        time.sleep(0.05)
    if proc.wait(timeout=900) != 0:
        raise SystemExit(f"{name} failed (code {proc.returncode}); see {ws / (name + '.log')}")
    return first


def summary(label: str, values: List[float]) -> str:
    if not values:
        return f"{label:<26} -"
    return (f"{label:<26} median {statistics.median(values):6.1f} s   range {min(values):6.1f} - {max(values):6.1f} s"
            f"   (n={len(values)})")


def phases(python: str, ws: Path, overrides: List[str], env: Dict[str, str], result: Result) -> int:
    for name, ranks in (("phases_2rank", 2), ("phases_1rank", 1)):
        trace = ws / f"trace_{name}"
        trace.mkdir(exist_ok=True)
        for old in trace.glob("*.jsonl"):
            old.unlink()
        traced = {**env, "BENCH_START_TRACE": str(trace),
                  "PYTHONPATH": os.pathsep.join((str(TRACER), env["PYTHONPATH"]))}
        wall: List[float] = []
        seconds = start_to_first_step(python, ws, name, ranks, overrides, traced, wall)
        text = timeline(trace, zero=wall[0])
        print(f"\n===== {name}: {seconds:.1f} s from start to step 1's metrics line =====")
        print(text, flush=True)
        result.row({"name": name, "kind": "phases", "ranks": ranks, "seconds_to_step_1": seconds, "timeline": text},
                   echo=False)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="warm rounds (each: A 2-rank, B 2-rank, A 1-rank)")
    parser.add_argument("--keep", type=Path, default=None, help="workspace to keep (default: a temporary one)")
    parser.add_argument("--phases", action="store_true", help="trace one 2-rank and one 1-rank start, phase by phase")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout of dsrecipes (e.g. `git worktree add /tmp/before main`): each warm round "
                        "also runs its 2-rank and 1-rank start with interpreter A, interleaved (a before/after A/B)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (e.g. offload=cpu_optimizer)")
    args = add_args(parser).parse_args()
    with Result("bench_rank_start", args) as result:
        return measure(args, result)


def measure(args: argparse.Namespace, result: Result) -> int:
    ws = args.keep or (result.out / "workspace" if args.smoke else Path(tempfile.mkdtemp(prefix="bench_rank_start_")))
    ws.mkdir(parents=True, exist_ok=True)
    cache = ws / "cache"
    pythons = {"A": sys.executable, "B": environment_b(ws / "venv_b")}
    print(f"workspace {ws}\nA: {pythons['A']}\nB: {pythons['B']}\noverrides: {args.overrides}", flush=True)
    result.extra.update(workspace=str(ws), pythons=pythons)
    # the data (tokenized once, content-keyed; zero/offload are not part of its key), with a cache of its own and
    # without the overrides, so no op gets built here
    if not args.smoke:  # (--smoke: B's one run prepares the data itself)
        start_to_first_step(pythons["A"], ws, "prepare", 1, [], environment(ws, ws / "prepare_cache"))
    env = environment(ws, cache)
    envs = {"A": env, "B": env}
    if args.before:
        pythons["before"], envs["before"] = pythons["A"], environment(ws, cache, args.before.resolve())
        start_to_first_step(pythons["A"], ws, "prepare_before", 1, [],
                            environment(ws, ws / "prepare_cache", args.before.resolve()))
    if args.phases:
        return phases(pythons["A"], ws, args.overrides, env, result)
    results: List[Tuple[str, str, float, str]] = []
    cpu: Dict[str, List[float]] = {}

    def one(kind: str, who: str, ranks: int, name: str) -> None:
        before, cpu_before = built_ops(cache), cpu_seconds()
        seconds = start_to_first_step(pythons[who], ws, name, ranks, args.overrides, envs[who])
        cpu.setdefault(kind, []).append(cpu_seconds() - cpu_before)
        after = built_ops(cache)
        rebuilt = sorted(k for k in before if k in after and after[k] != before[k])
        note = ("rebuilt " + ", ".join(rebuilt)) if rebuilt else ("built " + ", ".join(sorted(set(after) - set(before)))
                                                                  if set(after) - set(before) else "")
        results.append((kind, who, seconds, note))
        result.row({"name": name, "kind": kind, "env": who, "ranks": ranks, "seconds_to_step_1": seconds,
                    "cpu_s": cpu[kind][-1], "ops": note}, echo=False)
        print(f"{name:<14} {kind:<6} env {who} {ranks} rank(s): {seconds:6.1f} s to step 1, whole run "
              f"{cpu[kind][-1]:6.1f} CPU s  {note}", flush=True)

    if args.smoke:
        result.note("smoke: no 2-rank start, no rounds, no separate data preparation: one 1-rank start of B (kind "
                    "`smoke1B`, preparing its data); --phases is smoke-tested by start_trace/timeline.py --smoke")
        one("smoke1B", "B", 1, "smoke_B1")
        return 0
    one("cold", "A", 2, "cold_A")
    one("cold", "B", 2, "cold_B")
    for i in range(args.pairs):
        plan = [("A", 2), ("B", 2), ("A", 1)] + ([("before", 2), ("before", 1)] if args.before else [])
        plan = plan[i % len(plan):] + plan[:i % len(plan)]  # rotate: the order changes every round
        for who, ranks in plan:
            kind = ("warm" if ranks == 2 else "1rank") if who != "before" else f"before{ranks}"
            one(kind, who, ranks, f"warm{i}_{who}{ranks}")
    print()
    for kind, who in (("cold", "A"), ("cold", "B"), ("warm", "A"), ("warm", "B"), ("1rank", "A"),
                      ("before2", "before"), ("before1", "before")):
        label = {"1rank": "1-rank A (warm)", "before2": "before: 2-rank", "before1": "before: 1-rank"}
        print(summary(label.get(kind, f"{kind} {who}"), [s for k, w, s, _ in results if k == kind and w == who]))
    warm = [s for k, _, s, _ in results if k == "warm"]
    single = [s for k, _, s, _ in results if k == "1rank"]
    if warm and single:
        print(f"warm 2-rank minus 1-rank (medians): {statistics.median(warm) - statistics.median(single):+.1f} s")
    old2, old1 = ([s for k, _, s, _ in results if k == kind] for kind in ("before2", "before1"))
    if old2 and old1:
        print(f"before: 2-rank minus 1-rank (medians): {statistics.median(old2) - statistics.median(old1):+.1f} s")
    for kind, values in cpu.items():
        print(summary(f"CPU s, whole run, {kind}", values))
    rebuilds = [r for r in results if r[3].startswith("rebuilt") and r[0] != "cold"]
    print(f"warm runs that rebuilt an op: {len(rebuilds)}")
    print(f"op libraries: {sorted(built_ops(cache))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
