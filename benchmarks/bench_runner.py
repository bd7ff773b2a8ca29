"""Runner overhead: CPU time per optimizer step of `dsrecipes.train.train` vs a bare DeepSpeed loop, A/B/A/B.

    python benchmarks/bench_runner.py                       # default config (tiny model, sample data), 1 process
    python benchmarks/bench_runner.py --pairs 20 zero=stage2 precision=bf16

Both loops run in this one process, in pairs (bare then runner, runner then bare, ...): each run gets a fresh engine
(not timed), runs --warmup untimed steps, then --steps - --warmup timed ones. The reported overhead is the median
over pairs of (runner time / bare time), with its interquartile range and extremes: pairing neighbours cancels slow
drifts of the machine. On a shared machine wall time mostly measures the neighbours, so by default both are timed
with this process's CPU time (`time.process_time` stands in for `time.perf_counter`, which the runner's metrics
use) on one torch thread: that counts the work each loop does, whatever else runs. `--clock wall --threads N` for
wall time. The runner's timed steps come from its own metrics.jsonl (a log line every --warmup steps, eval and
checkpoints off; the log lines' all_reduce, JSON and TensorBoard writes are part of what it costs). The bare loop is
what a user would write by hand: our data loader, the model's own loss (`labels=`), engine.backward, engine.step
(with the same LR scheduler object), nothing else. Target: runner <= 3% slower per step.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple


def make_run_dir(root: Path, name: str, overrides: List[str], steps: int, warmup: int) -> Tuple[object, Path]:
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.entry import write_run_dir
    from dsrecipes.topology import Topology

    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = compose_and_load([
        *overrides, f"trainer.max_steps={steps}", f"trainer.log_every={warmup}", "trainer.save_every=0",
        "trainer.eval_every=0", "dataset.val_size=0", "trainer.export=false", "trainer.resume=never",
        f"trainer.output_dir={run_dir}", f"data.cache_dir={root / 'cache'}",
    ])
    write_run_dir(cfg, Topology(1, 1, 1))  # what `python -m dsrecipes` writes before launching
    return cfg, run_dir


def bare_loop(cfg, run_dir: Path, steps: int, warmup: int) -> Tuple[float, int]:
    """(seconds, real tokens) of steps warmup+1..steps of a hand-written DeepSpeed loop."""
    import deepspeed

    from dsrecipes.data.strategies import build_train_loader
    from dsrecipes.model import build_model, load_tokenizer
    from dsrecipes.rundir import read_ds_config
    from dsrecipes.schedule import StepScheduler
    from dsrecipes.train import seed_everything

    seed_everything(cfg.trainer.seed)
    tokenizer = load_tokenizer(cfg)
    model = build_model(cfg, tokenizer)
    loader = build_train_loader(cfg, tokenizer, 0, 1, run_dir)
    schedule = lambda opt: StepScheduler(opt, cfg.scheduler, cfg.optimizer.lr, steps)  # noqa: E731 (the same lr)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad],
                                           config=read_ds_config(run_dir), lr_scheduler=schedule)
    loader.set_epoch(0)
    batches = iter(loader)
    tokens, start = 0, time.perf_counter()
    for step in range(steps):
        if step == warmup:
            tokens, start = 0, time.perf_counter()
        for _ in range(cfg.trainer.grad_accum):
            batch = next(batches)
            mask = batch["attention_mask"]
            out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                         attention_mask=mask, use_cache=False)
            engine.backward(out.loss)
            engine.step()
            tokens += int(batch["num_tokens"])
    return time.perf_counter() - start, tokens


def runner_loop(cfg, run_dir: Path, warmup: int) -> float:
    """Seconds the runner spent on steps warmup+1..max_steps (its own elapsed clock)."""
    from dsrecipes.rundir import read_metrics
    from dsrecipes.train import train

    train(cfg, run_dir)
    elapsed = {r["step"]: r["elapsed"] for r in read_metrics(run_dir) if "loss" in r}
    return elapsed[cfg.trainer.max_steps] - elapsed[warmup]


def component_costs(cfg, run_dir: Path, iterations: int = 40) -> Tuple[float, float]:
    """What the runner adds, measured directly (A/B per iteration, so load hits both alike): (our loss / the model's
    own loss, fwd+bwd time ratio), and microseconds of per-micro-batch bookkeeping (metric window + progress bar)."""
    import torch

    from dsrecipes.data.strategies import build_train_loader
    from dsrecipes.metrics import Window
    from dsrecipes.model import build_model, load_tokenizer, micro_batch_loss

    tokenizer = load_tokenizer(cfg)
    model = build_model(cfg, tokenizer)
    loader = build_train_loader(cfg, tokenizer, 0, 1, run_dir)
    loader.set_epoch(0)
    batch = next(iter(loader))
    spent = {"model": 0.0, "ours": 0.0}
    for i in range(iterations):
        for which in ("model", "ours") if i % 2 else ("ours", "model"):
            start = time.perf_counter()
            if which == "model":
                loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                             attention_mask=batch["attention_mask"], use_cache=False).loss
            else:
                loss, _ = micro_batch_loss(model, batch, torch.device("cpu"))
            loss.backward()
            model.zero_grad()
            if i >= 3:
                spent[which] += time.perf_counter() - start
    from tqdm.auto import tqdm

    window, bar, n = Window(), tqdm(total=10**6, disable=True), 5000
    window.reset()
    start = time.perf_counter()
    for _ in range(n):
        window.add(loss, batch)
        bar.update(1)
    return spent["ours"] / spent["model"], 1e6 * (time.perf_counter() - start) / n


def run_pairs(args, root: Path) -> Tuple[List[float], List[float], object, Path, int]:
    bare_s, runner_s, tokens = [], [], 0
    for i in range(args.pairs):
        for which in ("bare", "runner") if i % 2 == 0 else ("runner", "bare"):  # alternate: no order bias
            cfg, run_dir = make_run_dir(root, f"{which}{i}", args.overrides, args.steps, args.warmup)
            if which == "bare":
                seconds, tokens = bare_loop(cfg, run_dir, args.steps, args.warmup)
                bare_s.append(seconds)
            else:
                runner_s.append(runner_loop(cfg, run_dir, args.warmup))
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the runner's final save: disk, not time
        print(f"pair {i + 1}: bare {bare_s[-1]:.3f} s, runner {runner_s[-1]:.3f} s "
              f"({100 * (runner_s[-1] / bare_s[-1] - 1):+.1f}%)", flush=True)
    return bare_s, runner_s, cfg, run_dir, tokens


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="untimed first steps (must divide --steps)")
    parser.add_argument("--pairs", type=int, default=12, help="bare/runner pairs (order alternates)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (cpu clock: keep 1)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. zero=stage2 precision=bf16")
    args = parser.parse_args(argv)
    if args.steps % args.warmup:
        parser.error("--warmup must divide --steps (the runner logs every --warmup steps)")
    import os

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch: the runner keeps the thread count it finds
    import torch

    from dsrecipes.distributed import init_distributed

    torch.set_num_threads(args.threads)
    init_distributed()
    if args.clock == "cpu":
        time.perf_counter = time.process_time  # both loops and the runner's metrics read this clock
    with tempfile.TemporaryDirectory(prefix="bench_runner_") as tmp:
        bare_s, runner_s, cfg, run_dir, tokens = run_pairs(args, Path(tmp))
        loss_ratio, bookkeeping_us = component_costs(cfg, run_dir)
    timed = args.steps - args.warmup
    ratios = sorted(r / b for r, b in zip(runner_s, bare_s))
    q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    bare, runner = statistics.median(bare_s), statistics.median(runner_s)
    unit = "CPU" if args.clock == "cpu" else "wall"
    print(f"bare DeepSpeed loop: {1000 * bare / timed:.2f} {unit} ms/step, {tokens / bare:,.0f} tokens per {unit} s")
    print(f"dsrecipes runner:    {1000 * runner / timed:.2f} {unit} ms/step, {tokens / runner:,.0f} tokens per {unit} s")
    print(f"runner overhead per step: {100 * (statistics.median(ratios) - 1):+.1f}% (median of {len(ratios)} pairs; "
          f"interquartile {100 * (q1 - 1):+.1f}% .. {100 * (q3 - 1):+.1f}%, extremes {100 * (ratios[0] - 1):+.1f}% .. "
          f"{100 * (ratios[-1] - 1):+.1f}%; {unit} time of {timed} steps per run)")
    print(f"components: runner loss / model loss fwd+bwd time x{loss_ratio:.3f}; "
          f"bookkeeping {bookkeeping_us:.1f} us per micro-batch ({100 * bookkeeping_us / (1e6 * runner / timed):.3f}% "
          "of a step); plus one metrics line (all_reduce, JSON, TensorBoard) per log window")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
