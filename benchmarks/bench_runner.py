"""Runner overhead: CPU time per optimizer step of dsrecipes' training loop vs a bare DeepSpeed loop, A/B/A/B.

    python benchmarks/bench_runner.py                        # default config (tiny model, sample data), 1 process
    python benchmarks/bench_runner.py --pairs 30 zero=stage2 precision=bf16
    python benchmarks/bench_runner.py --smoke               # 2 pairs of 2-step blocks: every phase in seconds

One process, one warm state: `dsrecipes.rank.train.start()` builds the run's session (model, engine, loader, metrics)
once; then blocks of --block optimizer steps alternate on that same engine, each on the same recorded micro-batches
(the first block of the run's own loader, replayed): the runner's own
`train.loop()` (its loss, metric windows, progress bar, lr/grad-norm bookkeeping, a metrics line with its all_reduce,
JSON and TensorBoard writes every `trainer.log_every` steps) and a bare loop a user would write by hand (the model's
own loss via `labels=`, engine.backward, engine.step, nothing else; the same LR scheduler object, which DeepSpeed
steps inside engine.step). One untimed block of each first; then pairs alternate their order (runner first, then bare
first). The overhead is the median over pairs of (runner block time / bare block time), with its interquartile range
and extremes.

Each runner block is a whole `train.loop()`: its last step does what a run does once at its end (the final log line,
evaluation, the save bookkeeping; the save itself is switched off). With 20-step blocks that end-of-run work was
charged every 20 steps: +6.2% / +8.4% on the 0.64M default model (12 pairs, load ~10 / ~2), mostly system time from
twice the page faults per block, against +0.1% [-2.5%, +0.8%] with 100-step blocks at load ~2 - hence the default.

On a shared machine wall time mostly measures the neighbours, so by default both are timed with this process's
CPU time on one torch thread (`time.process_time` stands in for `time.perf_counter`, which the runner's clock
uses): that counts the work each loop does, whatever else runs. `--clock wall --threads N` for wall time.
Checkpoints (the runner saves at the end of each of its blocks) are switched off for the measurement: they are
I/O, not loop overhead. Target: runner <= 3% slower per step. Result file: <out>/bench_runner.json (--out DIR).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple

from _harness import Result, add_args

_CLAIMS: List[object] = []  # run directories held (locked) for the whole benchmark, as `python -m dsrecipes` does


def make_run_dir(root: Path, overrides: List[str], steps: int) -> Tuple[Any, Path]:
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.rundir import claim
    from dsrecipes.core.topology import Topology
    from dsrecipes.run.entry import write_run_dir

    run_dir = root / "run"
    _CLAIMS.append(claim(run_dir, "benchmark run directory", "benchmark"))
    cfg = compose_and_load([
        *overrides, f"trainer.max_steps={steps}", "trainer.save_every=0", "trainer.eval_every=0",
        "dataset.val_size=0", "trainer.export=false", "trainer.resume=never", f"trainer.output_dir={run_dir}",
        f"data.cache_dir={root / 'cache'}",
    ])
    write_run_dir(cfg, Topology(1, 1, 1))  # what `python -m dsrecipes` writes before launching
    return cfg, run_dir


class ReplayLoader:
    """The same micro-batches, in the same order, for every block: both loops do exactly the same arithmetic (a
    block of other batches costs more or less with their lengths, which would swamp a 3% difference)."""

    def __init__(self, batches: List[Any]):
        self.batches = batches
        self.steps_per_epoch = None

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        return iter(self.batches)


def replay(session: Any, steps: int) -> None:
    import itertools

    loader = session.train_loader
    loader.set_epoch(0)
    micro = steps * session.cfg.trainer.grad_accum
    session.train_loader = ReplayLoader(list(itertools.islice(iter(loader), micro)))


def runner_block(session: Any, steps: int) -> float:
    """Seconds of the runner's loop for `steps` optimizer steps (its metrics lines included, the last one too)."""
    from dsrecipes.rank.train import loop

    session.plan = dataclasses.replace(session.plan, total_steps=session.state.step + steps)
    start = time.perf_counter()
    loop(session)
    return time.perf_counter() - start


def bare_block(session: Any, steps: int) -> Tuple[float, int]:
    """(seconds, real tokens) of `steps` hand-written optimizer steps on the same engine and data stream."""
    from dsrecipes.rank.train import micro_batches

    engine, accum = session.engine, session.cfg.trainer.grad_accum
    batches = micro_batches(session.train_loader, session.state)
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        for _ in range(accum):
            batch = next(batches)
            out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                         attention_mask=batch["attention_mask"], use_cache=False)
            engine.backward(out.loss)
            engine.step()
            tokens += int(batch["num_tokens"])
    seconds = time.perf_counter() - start
    session.state.step += steps  # what the runner's next block continues from
    return seconds, tokens


def component_costs(session: Any, iterations: int = 40) -> Tuple[float, float]:
    """What the runner adds, measured directly (A/B per iteration): (our loss / the model's own loss, fwd+bwd time
    ratio), and microseconds of per-micro-batch bookkeeping (metric window + progress bar)."""
    import torch

    from dsrecipes.objectives.sft import micro_batch_loss
    from dsrecipes.rank.step_window import Window

    model = session.engine.module
    batch = next(iter(session.train_loader))
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


def run_pairs(args: argparse.Namespace, session: Any, result: Result) -> Tuple[List[float], List[float], int]:
    replay(session, args.block)
    runner_block(session, args.block)  # untimed: first steps allocate, and the bare loop gets its warm-up below
    bare_block(session, args.block)
    bare_s, runner_s, tokens = [], [], 0
    for i in range(args.pairs):
        for which in ("runner", "bare") if i % 2 == 0 else ("bare", "runner"):  # alternate: no order bias
            if which == "bare":
                seconds, tokens = bare_block(session, args.block)
                bare_s.append(seconds)
            else:
                runner_s.append(runner_block(session, args.block))
        print(f"pair {i + 1}: bare {bare_s[-1]:.3f} s, runner {runner_s[-1]:.3f} s "
              f"({100 * (runner_s[-1] / bare_s[-1] - 1):+.1f}%)", flush=True)
        result.row({"pair": i + 1, "bare_s": bare_s[-1], "runner_s": runner_s[-1]}, echo=False)
    return bare_s, runner_s, tokens


def report(args: argparse.Namespace, bare_s: List[float], runner_s: List[float], tokens: int,
           components: Optional[Tuple[float, float]], result: Result) -> None:
    ratios = sorted(r / b for r, b in zip(runner_s, bare_s))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    bare, runner = statistics.median(bare_s), statistics.median(runner_s)
    result.extra["summary"] = {"clock": args.clock, "block": args.block, "bare_s_per_step": bare / args.block,
                               "runner_s_per_step": runner / args.block, "overhead_median": statistics.median(ratios) - 1,
                               "overhead_interquartile": [q1 - 1, q3 - 1], "overhead_extremes": [ratios[0] - 1,
                                                                                                 ratios[-1] - 1],
                               "components": components}
    unit = "CPU" if args.clock == "cpu" else "wall"
    print(f"bare DeepSpeed loop: {1000 * bare / args.block:.2f} {unit} ms/step, {tokens / bare:,.0f} tokens per {unit} s")
    print(f"dsrecipes runner:    {1000 * runner / args.block:.2f} {unit} ms/step, {tokens / runner:,.0f} tokens per "
          f"{unit} s")
    print(f"runner overhead per step: {100 * (statistics.median(ratios) - 1):+.1f}% (median of {len(ratios)} pairs; "
          f"interquartile {100 * (q1 - 1):+.1f}% .. {100 * (q3 - 1):+.1f}%, extremes {100 * (ratios[0] - 1):+.1f}% .. "
          f"{100 * (ratios[-1] - 1):+.1f}%; {unit} time of {args.block}-step blocks on one engine)")
    if components is None:
        return
    loss_ratio, bookkeeping_us = components
    print(f"components: runner loss / model loss fwd+bwd time x{loss_ratio:.3f}; bookkeeping {bookkeeping_us:.1f} us "
          f"per micro-batch ({100 * bookkeeping_us / (1e6 * runner / args.block):.3f}% of a step); plus one metrics "
          "line (all_reduce, JSON, TensorBoard) per log window")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block", type=int, default=100, help="optimizer steps per timed block (each runner block "
                        "ends like a run: its last step's log line, final evaluation and save bookkeeping)")
    parser.add_argument("--pairs", type=int, default=20, help="runner/bare block pairs (order alternates)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (cpu clock: keep 1)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. zero=stage2 precision=bf16")
    args = add_args(parser).parse_args(argv)
    if args.smoke:
        args.block, args.pairs = 2, 2
    with Result("bench_runner", args) as result:
        measure(args, result)
    return 0


def measure(args: argparse.Namespace, result: Result) -> None:
    import os

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch: the runner keeps the thread count it finds
    import torch

    from dsrecipes.rank import train

    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        time.perf_counter = time.process_time  # both loops and the runner's clock read this
    train.save_checkpoint = lambda *a, **k: None  # each runner block ends in a save: I/O, not loop overhead
    with tempfile.TemporaryDirectory(prefix="bench_runner_") as tmp:
        total = 2 * (args.pairs + 1) * args.block
        cfg, run_dir = make_run_dir(Path(tmp), args.overrides, total)
        session = train.start(cfg, run_dir)
        bare_s, runner_s, tokens = run_pairs(args, session, result)
        # (the module alone, outside the engine: only where ZeRO puts no hooks on its parameters)
        components = component_costs(session, 6 if args.smoke else 40) if cfg.zero.stage == 0 else None
        if components is None:
            result.note(f"component costs not measured: ZeRO stage {cfg.zero.stage} hooks the module's parameters")
        session.metrics.close()
    report(args, bare_s, runner_s, tokens, components, result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
