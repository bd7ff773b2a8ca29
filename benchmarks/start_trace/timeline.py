"""Print the phase timeline of one traced run (the JSON lines sitecustomize.py wrote), process by process.

    python benchmarks/start_trace/timeline.py TRACE_DIR
    python benchmarks/start_trace/timeline.py --smoke [--out DIR]   # trace a `dsrecipes audit` and print it

Times are seconds since the first process (the CLI) was started (a child's start: its parent's Popen); `cpu` is that process's own CPU seconds at that
moment. An import or call prints at its end, with its duration. `--smoke` traces one short real command
(`python -m dsrecipes audit`, sitecustomize.py on PYTHONPATH) into <out>/trace, checks that its process, imports and
a watched call were recorded, and prints the timeline; result file <out>/start_trace_timeline.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROLES = (("deepspeed.launcher.runner", "deepspeed runner"), ("deepspeed.launcher.launch", "deepspeed launch.py"),
         ("dsrecipes.rank.worker", "rank"), ("dsrecipes", "CLI"))
SHOWN_IMPORTS = ("torch", "deepspeed", "transformers", "datasets", "hydra", "dsrecipes.rank.worker", "dsrecipes.rank.train",
                 "dsrecipes.run.entry", "deepspeed.launcher.runner", "deepspeed.launcher.launch", "dsrecipes.cli")


def role(argv: List[str]) -> str:
    text = " ".join(argv)
    for needle, name in ROLES:
        if needle in text:
            if name == "rank":
                local = next((a.split("=", 1)[1] for a in argv if a.startswith("--local_rank=")), "?")
                return f"rank (local {local})"
            return name
    return " ".join(argv[:3])


def load(trace: Path) -> Dict[int, List[dict]]:
    procs: Dict[int, List[dict]] = {}
    for path in sorted(trace.glob("*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if events:
            procs[events[0]["pid"]] = events
    return procs


def spawn_times(procs: Dict[int, List[dict]]) -> Dict[int, float]:
    """child pid -> when its parent called Popen (a "spawn" event is followed by its "spawned" with the pid)."""
    times: Dict[int, float] = {}
    for events in procs.values():
        for before, after in zip(events, events[1:]):
            if before["event"] == "spawn" and after["event"] == "spawned":
                times[after["child"]] = before["t"]
    return times


def timeline(trace: Path, zero: Optional[float] = None) -> str:
    """`zero`: when the first process was started (time.time()); default: its creation time from /proc."""
    procs = load(trace)
    if not procs:
        return f"no trace in {trace}"
    spawned = spawn_times(procs)
    if zero is None:
        zero = min(e[0]["t0"] for e in procs.values() if e[0]["event"] == "start")
    for pid, events in procs.items():  # /proc's creation time can be off by a constant; a parent's Popen is not
        if events[0]["event"] == "start":
            events[0]["t0"] = spawned.get(pid, zero)
    lines: List[str] = []
    total_cpu = 0.0
    for pid, events in sorted(procs.items(), key=lambda kv: kv[1][0].get("t0", kv[1][0]["t"])):
        first = events[0]
        lines.append(f"\n[{role(first.get('argv', []))}] pid {pid}")
        lines.append(f"  {first.get('t0', first['t']) - zero:7.2f} s  created")
        opened: Dict[str, dict] = {}
        for e in events[1:]:
            at = f"  {e['t'] - zero:7.2f} s  cpu {e['cpu']:6.2f}  "
            kind = e["event"]
            if kind == "site":
                lines.append(at + "interpreter ready")
            elif kind in ("import", "call"):
                key = f"{kind} {e['name']}"
                if e["edge"] == "start":
                    opened[key] = e
                elif kind == "call" or e["name"] in SHOWN_IMPORTS:
                    began = opened.pop(key, e)
                    lines.append(at + f"{key:<48} {e['t'] - began['t']:6.2f} s  ({e['cpu'] - began['cpu']:.2f} cpu)")
            elif kind == "spawned":
                continue
            elif kind == "spawn":
                argv = e["argv"] if isinstance(e["argv"], list) else [e["argv"]]
                lines.append(at + "spawn " + " ".join(argv)[:110])
            elif kind == "exit":
                total_cpu += e["cpu"]
                lines.append(at + f"exit (children reaped: {e['children_cpu']:.2f} cpu)")
    lines.append(f"\nCPU seconds, all traced processes: {total_cpu:.1f}")
    return "\n".join(lines)


def smoke() -> int:
    import argparse

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent))
    from _harness import REPO, Result, add_args

    args = add_args(argparse.ArgumentParser(description="trace one short command and print its timeline")).parse_args()
    with Result("start_trace_timeline", args) as result:
        trace = result.out / "trace"
        trace.mkdir(exist_ok=True)
        env = {**os.environ, "BENCH_START_TRACE": str(trace),
               "PYTHONPATH": os.pathsep.join(p for p in (str(here), str(REPO), os.environ.get("PYTHONPATH")) if p)}
        cmd = [sys.executable, "-m", "dsrecipes", "audit", "--num-rows", "64", "--world-size", "2",
               "trainer.micro_batch_size=4"]
        done = subprocess.run(cmd, env=env, cwd=result.out, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
        events = [e for evs in load(trace).values() for e in evs]
        kinds = {e["event"] for e in events}
        calls = sorted({e["name"] for e in events if e["event"] == "call"})
        result.row({"processes": len(load(trace)), "events": len(events), "kinds": sorted(kinds), "calls": calls})
        missing = {"start", "site", "import", "call", "exit"} - kinds
        if missing:
            raise SystemExit(f"the trace of {' '.join(cmd)} has no {sorted(missing)} events (in {trace})")
        text = timeline(trace)
        print(text)
        result.extra["timeline"] = text
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--smoke"]:
        raise SystemExit(smoke())
    print(timeline(Path(sys.argv[1])))
