"""Packing vs padding-to-longest: slot utilisation and effective (non-pad) tokens/s, tiny model, real data path.

    python benchmarks/bench_packing.py                  # bundled sample data + a synthetic long-tailed mix
    python benchmarks/bench_packing.py --steps 40 --cutoff 512
    python benchmarks/bench_packing.py --smoke          # long-tail data only, 60 rows, 2 timed micro-batches

For each dataset the same rows go through `prepare` and the map strategy's loader twice: one sample per row padded
to the longest row of its micro-batch (`data.packing=false`, micro batch 8), and best-fit-decreasing packed rows of
`data.cutoff_len` (`data.packing=true`, micro batch 2). Utilisation = real tokens / token slots over a whole epoch.
Speed = real tokens per second of forward + backward + AdamW step on the tiny model with the runner's own loss,
timed on this process's CPU clock with one torch thread (robust to other load on the machine), --reps times
(default 3), padded then packed, then packed then padded, ...; the speed-up is packed / padded of the same repetition,
reported as median [min, max]. Target: >= 95%
slot utilisation with packing. Data: the bundled sample rows and a generated long-tailed mix. Result file:
<out>/bench_packing.json (--out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from _harness import Result, add_args

WORDS = ("data model train token batch layer weight memory rank shard step loss sample query answer value time "
         "river stone cloud light paper garden window market signal engine vector matrix").split()


def long_tailed_jsonl(path: Path, rows: int, seed: int = 0) -> Path:
    """ShareGPT rows whose answers have log-normal word counts: mostly short, a few near the cutoff."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(rows):
            words = min(300, max(1, int(rng.lognormvariate(3.0, 1.0))))
            answer = " ".join(rng.choice(WORDS) for _ in range(words))
            row = {"id": f"tail-{i}", "conversations": [{"from": "human", "value": f"Describe item {i}."},
                                                         {"from": "gpt", "value": answer}]}
            fh.write(json.dumps(row) + "\n")
    return path


def measure(root: Path, name: str, data_file: Path, packing: bool, cutoff: int, steps: int, warmup: int) -> Dict:
    import torch

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.core.topology import Topology
    from dsrecipes.data.strategies import build_loaders
    from dsrecipes.modeling.model import build_model
    from dsrecipes.objectives.sft import micro_batch_loss
    from dsrecipes.run.entry import write_run_dir

    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = compose_and_load([
        f"dataset.paths=[{data_file}]", "dataset.val_size=0", f"data.cutoff_len={cutoff}",
        f"data.packing={str(packing).lower()}", f"trainer.micro_batch_size={2 if packing else 8}",
        f"data.cache_dir={root / 'cache'}", f"trainer.output_dir={run_dir}",
    ])
    tokenizer = load_tokenizer(cfg)
    plan = write_run_dir(cfg, Topology(1, 1, 1))  # prepare and plan, as the launching process does
    loader = build_loaders(cfg, tokenizer, 0, 1, run_dir, plan)[0]
    loader.set_epoch(0)
    batches = list(loader)
    real = sum(int(b["num_tokens"]) for b in batches)
    slots = sum(b["input_ids"].numel() for b in batches)

    torch.manual_seed(0)
    model = build_model(cfg, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    device = torch.device("cpu")
    timed = batches[warmup:warmup + steps]
    for batch in batches[:warmup]:
        micro_batch_loss(model, batch, device)[0].backward()
        optimizer.step()
        optimizer.zero_grad()
    start = time.process_time()
    for batch in timed:
        micro_batch_loss(model, batch, device)[0].backward()
        optimizer.step()
        optimizer.zero_grad()
    seconds = time.process_time() - start
    tokens = sum(int(b["num_tokens"]) for b in timed)
    return {"rows": len(loader.rows), "micro_batches": len(batches), "utilisation": real / slots,
            "tokens_per_cpu_s": tokens / seconds, "timed_micro_batches": len(timed)}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed micro-batches per configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of both modes, alternating order")
    parser.add_argument("--cutoff", type=int, default=512)
    parser.add_argument("--tail-rows", type=int, default=1500)
    args = add_args(parser).parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.cutoff, args.tail_rows, args.reps = 2, 1, 256, 60, 1
    with Result("bench_packing", args) as result:
        run(args, result)
    return 0


def run(args: argparse.Namespace, result: Result) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from dsrecipes.core.paths import SAMPLE_DATA_DIR

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        root = Path(tmp)
        datasets = {"sample": SAMPLE_DATA_DIR / "train.jsonl",
                    "long_tail": long_tailed_jsonl(root / "long_tail.jsonl", args.tail_rows)}
        if args.smoke:  # the same code for both datasets: the generated one only
            del datasets["sample"]
            result.note("smoke: the long_tail dataset only (the bundled sample dataset is not measured)")
        print(f"{'dataset':<10} {'mode':<8} {'rows':>6} {'micro-batches':>13} {'slot use':>9} {'tokens/CPU s':>13}")
        for data_name, path in datasets.items():
            runs = {"padded": [], "packed": []}
            for rep in range(args.reps):  # A/B, then B/A: drift and one-off costs fall on both modes alike
                for packing in modes_in(rep):
                    mode = "packed" if packing else "padded"
                    r = measure(root, f"{data_name}_{mode}_{rep}", path, packing, args.cutoff, args.steps, args.warmup)
                    runs[mode].append(r)
                    result.row({"dataset": data_name, "mode": mode, "rep": rep, **r}, echo=False)
                    if r["timed_micro_batches"] < args.steps and rep == 0:
                        result.note(f"{data_name} {mode}: only {r['timed_micro_batches']} micro-batches after the "
                                    f"warm-up (--steps {args.steps} asked)")
                    print(f"{data_name:<10} {mode:<8} {r['rows']:>6} {r['micro_batches']:>13} {r['utilisation']:>8.1%} "
                          f"{r['tokens_per_cpu_s']:>13,.0f}  (rep {rep})", flush=True)
            gains = [b["tokens_per_cpu_s"] / a["tokens_per_cpu_s"] for a, b in zip(runs["padded"], runs["packed"])]
            result.row({"dataset": data_name, "summary": True, "reps": args.reps,
                        **{f"{mode}_tokens_per_cpu_s": spread([r["tokens_per_cpu_s"] for r in rs])
                           for mode, rs in runs.items()}, "packing_speedup": spread(gains)}, echo=False)
            print(f"{data_name:<10} packing speed-up in real tokens per CPU second (packed / padded of the same "
                  f"repetition, median [min, max] over {args.reps}): x{statistics.median(gains):.2f} "
                  f"[{min(gains):.2f}, {max(gains):.2f}]")


def modes_in(rep: int) -> tuple:
    """The packing settings of repetition `rep`, in the order they run: padded first, then packed first, ..."""
    return (False, True) if rep % 2 == 0 else (True, False)


def spread(values: List[float]) -> Dict[str, object]:
    return {"median": statistics.median(values), "range": [min(values), max(values)]}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
