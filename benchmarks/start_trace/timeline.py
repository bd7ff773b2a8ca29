"""Print the phase timeline of one traced run (the JSON lines sitecustomize.py wrote), process by process.

    python benchmarks/start_trace/timeline.py TRACE_DIR

Times are seconds since the first process (the CLI) was started (a child's start: its parent's Popen); `cpu` is that process's own CPU seconds at that
moment. An import or call prints at its end, with its duration.
"""

from __future__ import annotations

import json
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


if __name__ == "__main__":
    print(timeline(Path(sys.argv[1])))
