"""Peak memory of each DPO reference mode: the same model, pairs and steps, 2 ranks (deepspeed launcher, CPU/gloo).

    python benchmarks/bench_dpo_reference.py [--model PATH] [--repeats 3] [--steps 3] [--out DIR]
    python benchmarks/bench_dpo_reference.py --smoke    # embedded tiny model, 1 rank, 1 step, mode live only

Modes (each a real `python -m dsrecipes` run, in alternating order: one of each, then the next repeat):
  precomputed       objective.reference=precomputed, zero=stage2: reference log-probs computed before training
  live              objective.reference=live, zero=stage2: a full frozen copy on each rank
  lora_precomputed  model.lora.enabled=true, objective.reference=precomputed (the baseline of the next: LoRA's
                    optimizer state is a fraction of full fine-tuning's, so lora_live against `live` would count
                    that saving as the reference's)
  lora_live         model.lora.enabled=true, objective.reference=live: the trained model with adapters disabled
  simpo             objective.loss=simpo: no reference at all
  precomputed_z3    objective.reference=precomputed, zero=stage3 (the baseline of the next)
  live_z3           objective.reference=live, zero=stage3: the reference in a ZeRO-3 inference engine

Measured per run: each rank's peak RSS (VmHWM of /proc/PID/status, read every 0.2 s until the rank exits; the
high-water mark only grows, so the last reading is the peak), the launching process's peak RSS (it prepares the
pairs and, for `precomputed`, runs the reference pass: a fresh data.cache_dir per run so that every run pays it),
and the reference parameters each rank holds (the rank's `live DPO reference holds H of its T parameters` line,
x bytes per element; 0 where no separate reference exists). Reported: median over the repeats and the spread
(min-max) of the larger rank's peak. Default model: SmolLM2-135M-Instruct as `scripts/fetch_smollm2.py` keeps it.
Result file: <out>/bench_dpo_reference.json (every run and the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import psutil
from _harness import Result, add_args

MODES: Dict[str, List[str]] = {
    "precomputed": ["zero=stage2"],
    "live": ["zero=stage2", "objective.reference=live"],
    "lora_precomputed": ["zero=stage2", "model.lora.enabled=true"],
    "lora_live": ["zero=stage2", "objective.reference=live", "model.lora.enabled=true"],
    "simpo": ["zero=stage2", "objective.loss=simpo", "objective.beta=2", "objective.simpo_gamma=1"],
    "precomputed_z3": ["zero=stage3"],
    "live_z3": ["zero=stage3", "objective.reference=live"],
}
HELD = re.compile(r"rank (\d+): live DPO reference holds ([\d,]+) of its ([\d,]+) parameters")
MIB = 1024 * 1024


def default_model() -> str:
    return str(Path.home() / ".cache" / "dsrecipes" / "models" / "SmolLM2-135M-Instruct")


def peak_rss(pid: int) -> int:
    """VmHWM of a live process in bytes (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def watch(proc: subprocess.Popen) -> Dict[str, object]:
    """Poll the run's process tree until it exits: peak RSS of the launching process and of each rank."""
    root, ranks = psutil.Process(proc.pid), {}
    launcher = 0
    while proc.poll() is None:
        launcher = max(launcher, peak_rss(proc.pid))
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            try:
                cmd = child.cmdline()
                if "-m" in cmd[:3] and cmd[cmd.index("-m") + 1:][:1] == ["dsrecipes.rank.worker"]:  # a rank, not its launcher
                    ranks[child.pid] = max(ranks.get(child.pid, 0), peak_rss(child.pid))
            except psutil.Error:
                continue
        time.sleep(0.2)
    return {"launcher": launcher, "ranks": sorted(ranks.values())}


def run_mode(mode: str, args: argparse.Namespace, workdir: Path, i: int) -> Dict[str, object]:
    run_dir = workdir / f"{mode}_{i}"
    model = [f"model.path={args.model}"] if args.model else []  # none: the embedded tiny model (--smoke)
    argv = [sys.executable, "-m", "dsrecipes", "objective=dpo", "dataset=sample_pairs", *model,
            f"dataset.max_samples={args.pairs}", "dataset.val_size=0", f"data.cutoff_len={args.cutoff}",
            "trainer.micro_batch_size=2", f"trainer.max_steps={args.steps}", "trainer.save_every=0",
            "trainer.eval_every=0", "trainer.export=false", "launcher=deepspeed", f"launcher.num_gpus={args.ranks}",
            f"data.cache_dir={run_dir}_cache", f"trainer.output_dir={run_dir}", f"hydra.run.dir={run_dir}",
            *MODES[mode]]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    with open(workdir / f"{mode}_{i}.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        peaks = watch(proc)
    text = (workdir / f"{mode}_{i}.log").read_text()
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}; see {workdir / f'{mode}_{i}.log'}\n{text[-3000:]}")
    if not peaks["ranks"]:
        raise SystemExit(f"{mode}: no rank process (dsrecipes.rank.worker) was seen; see the log\n{text[-3000:]}")
    held = [int(h.replace(",", "")) for _, h, _ in HELD.findall(text)]
    return {"mode": mode, "wall_s": round(time.monotonic() - started, 1), "launcher_peak": peaks["launcher"],
            "rank_peaks": peaks["ranks"], "ref_params_held": max(held, default=0)}


def from_log(path: str) -> List[Dict[str, object]]:
    """The per-run rows a (possibly unfinished) benchmark printed."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith('{"mode"')
            and "rank_peaks" in line]


def summarise(rows: List[Dict[str, object]], bytes_per_param: int) -> List[Dict[str, object]]:
    out = []
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        top = [max(r["rank_peaks"]) / MIB for r in mine]
        out.append({
            "mode": mode,
            "rank_peak_rss_mib": round(statistics.median(top)),
            "spread_mib": [round(min(top)), round(max(top))],
            "launcher_peak_rss_mib": round(statistics.median(r["launcher_peak"] / MIB for r in mine)),
            "ref_param_mib_per_rank": round(mine[0]["ref_params_held"] * bytes_per_param / MIB, 1),
            "wall_s": statistics.median(r["wall_s"] for r in mine),
            "runs": len(mine),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--cutoff", type=int, default=192)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--summarise", metavar="LOG", help="only summarise the run rows this benchmark printed")
    args = add_args(parser).parse_args()
    if args.smoke:
        args.model, args.repeats, args.steps, args.pairs, args.cutoff, args.ranks = "", 1, 1, 4, 192, 1
        args.modes = "live"
    with Result("bench_dpo_reference", args) as result:
        measure(args, result)


def measure(args: argparse.Namespace, result: Result) -> None:
    if args.smoke:
        result.note("smoke: the embedded tiny model (not --model), 1 rank, 1 step, mode live only (the other modes differ only in their overrides)")
    if args.summarise:
        for row in summarise(from_log(args.summarise), bytes_per_param=4):
            result.row(row)
        return
    if args.model and not Path(args.model).is_dir():
        raise SystemExit(f"--model {args.model}: not a directory; run `python scripts/fetch_smollm2.py` first")
    modes = args.modes.split(",")
    rows: List[Dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="bench_dpo_ref_") as tmp:
        for i in range(args.repeats):
            for mode in modes if i % 2 == 0 else modes[::-1]:  # alternate, so drift hits every mode alike
                rows.append(run_mode(mode, args, Path(tmp), i))
                print(json.dumps(rows[-1]), flush=True)
    summary = summarise(rows, bytes_per_param=4)  # fp32 (precision default on CPU)
    result.extra["runs"] = rows
    for row in summary:
        result.row(row)


if __name__ == "__main__":
    main()
